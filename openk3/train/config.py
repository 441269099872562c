"""TrainConfig: every setting of a training run, one dataclass, mapped 1:1 from `k3 train` flags.

Derived values (micro-batch count, warmup steps, the curriculum's lengths) are computed here and nowhere else.
The model itself is configured by `openk3.config.K3Config` (a preset); this file only adds the run's settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from openk3.config import PRESETS

BALANCE_METHODS = ("quantile", "sign", "none")
SCHEDULES = ("wsd", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")
OPTIMIZERS = ("adamw", "muon")
TOKENIZERS = ("bpe", "byte")
TRAIN_PRESETS = tuple(sorted(PRESETS))
VISION_PRESETS = ("tiny-vl",)  # presets with a vision tower: they train on --data vision
VISION_KINDS = ("text", "count", "colour")  # openk3.data.vision_tasks.KINDS (not imported: keeps Pillow out of here)


def flag(default, help: str, **meta):
    """A field that `k3 train` exposes as --field-name (train/flags.py builds the parser from this metadata).

    meta: `choices` (a closed set: shown in --help, checked by `validate`); `launch=True` (a setting of this launch,
    not of the run: on --resume it comes from this command line or the default, never from the saved run);
    `required=True`. A bool field is a switch: --field-name sets True, or --no-field-name sets False when the
    default is True."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    preset: str = flag("tiny", "model preset", choices=TRAIN_PRESETS)
    data: str | None = flag(None, "stdlib (the default of a text preset), mqar, needle, copy, recall, a path (text "
                            "file, folder, JSONL with 'text'), or vision (the embedded image-text tasks: the default "
                            "and only choice of tiny-vl)")  # fmt: skip
    tokenizer: str = flag("bpe", "bpe (trained on the corpus, saved with the checkpoint) or byte", choices=TOKENIZERS)
    steps: int = flag(200, "total optimizer steps of the run (the schedule's length)")
    stop_after: int | None = flag(None, "stop cleanly once this many steps are done (schedule unchanged)", launch=True)
    resume: bool = flag(False, "continue the run in --out up to --steps")
    seed: int = flag(0, "seed for weights, data order and evaluation")
    out: str = flag("runs/tiny", "run folder: checkpoints, metrics.jsonl, train_config.json", required=True)
    balance: str = flag("quantile", "router-bias balancing: quantile (K3), sign (DeepSeek-V3) or none",
                        choices=BALANCE_METHODS)  # fmt: skip
    balance_exact_thresholds: bool = flag(False, "quantile balancing with exact per-entry thresholds (a "
                                          "refinement, not K3's rule; helps small k)")  # fmt: skip
    # More bins resolve near-tied scores better.
    balance_bins: int = flag(1000, "quantile-balancing histogram bins (K3: 1000)")
    balance_ema: float = flag(0.0, "damped QB update b = ema*b_old + (1-ema)*b_new "
                              "(0: K3's rule)")  # fmt: skip
    batch_size: int = flag(16, "global batch in sequences of the final length")
    micro_batch_size: int | None = flag(None, "sequences per forward/backward (gradient accumulation; default: the "
                                        "whole batch)")  # fmt: skip
    seq_len: int = flag(256, "final sequence length of the curriculum")
    # K3 trained at 8K then 64K.
    curriculum: float = flag(0.5, "fraction of steps at seq_len // 4 before the full length (0 disables)")
    lr: float = flag(3e-3, "peak learning rate")
    min_lr_ratio: float = 0.1
    warmup: float = flag(0.05, "warmup fraction of the steps")
    schedule: str = flag("wsd", "wsd (warmup-stable-decay) or cosine", choices=SCHEDULES)
    decay_fraction: float = 0.2  # WSD: the final fraction of steps decays linearly to min_lr
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices")
    grad_clip: float = flag(1.0, "global gradient-norm clip")
    optimizer: str = flag("adamw", "adamw, or muon (Muon for hidden matrices + AdamW for the rest; one process)",
                          choices=OPTIMIZERS)  # fmt: skip
    beta1: float = 0.9
    beta2: float = 0.95
    device: str = flag("auto", "auto, cpu, cuda, cuda:1, ...")
    precision: str = flag("auto", "auto (bf16 autocast on CUDA when supported, fp32 on CPU), fp32 or bf16",
                          choices=PRECISIONS)  # fmt: skip
    activation_checkpointing: bool = flag(False, "recompute activations in backward")
    eval_every: int = flag(50, "evaluate every N steps (and at the end)")
    eval_batches: int = flag(4, "validation batches per evaluation")
    save_every: int = flag(100, "checkpoint every N steps, and at step 10, on Ctrl-C/SIGTERM and at the end")
    keep_checkpoints: int = flag(2, "complete checkpoints to keep")
    # Training stops with a good checkpoint after this many.
    max_nonfinite: int = flag(5, "non-finite steps in a row before stopping")
    sample_tokens: int = flag(64, "tokens of the sample printed after training (0: none)")
    progress: bool = flag(True, "no progress bar", launch=True)
    # The parallel layout (openk3.parallel), under torchrun: a property of the launch, so --resume may change it.
    dp: int = flag(1, "data-parallel degree (FSDP2); dp x ep x cp = the number of processes", launch=True)
    ep: int = flag(1, "expert-parallel degree (experts split over ranks, all-to-all dispatch)", launch=True)
    cp: int = flag(1, "context-parallel degree (contiguous sequence shards)", launch=True)
    # Vision runs (--preset tiny-vl, --data vision; train/vision_data.py): a row of the batch is one example.
    vision_kinds: str = flag("text,count,colour", "vision: the task kinds trained and evaluated (comma-separated, of "
                             "text, count, colour)")  # fmt: skip
    vision_eval_examples: int = flag(200, "vision: held-out examples per evaluation (greedy answers)")
    contrastive_steps: int = flag(0, "vision: CLIP-style InfoNCE pre-training steps of the tower before joint "
                                  "training (the report's alternative to from-scratch; 0: from scratch)")  # fmt: skip
    contrastive_lr: float = flag(1e-3, "vision: peak learning rate of the contrastive stage")
    # At 1e-3 and above the tower's from-scratch init collapses to one output vector (docs/notes.md); the text
    # model trains at 3e-3.
    vision_lr: float | None = flag(None, "vision: peak learning rate of the tower and projector (vision_tower.*, "
                                   "mm_projector.*), on the same schedule (default: --lr)")  # fmt: skip
    # A property of the machine, not the run: --resume on another machine picks its own default.
    threads: int | None = flag(None, "torch CPU threads per process (default: OMP_NUM_THREADS, else the physical "
                               "cores available / processes on this machine)", launch=True)  # fmt: skip

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = "vision" if self.preset in VISION_PRESETS else "stdlib"
        self.validate()

    @property
    def vision(self) -> bool:
        return self.data == "vision"

    @property
    def vision_kinds_tuple(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.vision_kinds.split(",") if k.strip())

    def validate(self) -> None:
        if (self.preset in VISION_PRESETS) != (self.data == "vision"):
            raise ValueError(f"--data vision goes with a vision preset ({', '.join(VISION_PRESETS)}) and a vision "
                             f"preset with --data vision; got --preset {self.preset} --data {self.data}")  # fmt: skip
        if self.vision:
            bad = [k for k in self.vision_kinds_tuple if k not in VISION_KINDS]
            if bad or not self.vision_kinds_tuple:
                raise ValueError(f"--vision-kinds must name some of {VISION_KINDS}, got {self.vision_kinds!r}")
            if self.dp * self.ep * self.cp > 1:
                raise ValueError("--data vision trains in one process (--dp/--ep/--cp 1): the vision batches are not "
                                 "sharded yet")  # fmt: skip
            if self.vision_eval_examples <= 0:
                raise ValueError(f"--vision-eval-examples must be positive, got {self.vision_eval_examples}")
        if self.vision_lr is not None and self.vision_lr <= 0:
            raise ValueError(f"--vision-lr must be positive, got {self.vision_lr}")
        if self.contrastive_lr <= 0:
            raise ValueError(f"--contrastive-lr must be positive, got {self.contrastive_lr}")
        if self.contrastive_steps < 0 or (self.contrastive_steps and not self.vision):
            raise ValueError(f"--contrastive-steps ({self.contrastive_steps}) must be >= 0 and needs --data vision")
        if self.steps <= 0:
            raise ValueError(f"--steps must be positive, got {self.steps}")
        if self.stop_after is not None and self.stop_after <= 0:
            raise ValueError(f"--stop-after must be positive, got {self.stop_after}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be positive, got {self.threads}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                flag_name = "--" + f.name.replace("_", "-")
                raise ValueError(f"{flag_name} must be one of {choices}, got {getattr(self, f.name)!r}")
        if not 0.0 <= self.balance_ema < 1.0:
            raise ValueError(f"--balance-ema must be in [0, 1), got {self.balance_ema}")
        if self.optimizer == "muon" and self.dp * self.ep * self.cp > 1:
            raise ValueError("--optimizer muon runs in one process: its Newton-Schulz step needs whole matrices, which "
                             "FSDP2 and expert parallelism shard; use --optimizer adamw with --dp/--ep/--cp")  # fmt: skip
        if self.batch_size <= 0 or self.seq_len <= 0:
            raise ValueError(f"--batch-size and --seq-len must be positive, got {self.batch_size}, {self.seq_len}")
        mb = self.micro_batch_size
        if mb is not None and (mb <= 0 or self.batch_size % mb):
            raise ValueError(f"--micro-batch-size ({mb}) must divide --batch-size ({self.batch_size})")
        if not 0 <= self.curriculum < 1:
            raise ValueError(f"--curriculum must be in [0, 1), got {self.curriculum}")
        if self.curriculum > 0 and self.seq_len % 4:
            raise ValueError(
                f"--seq-len ({self.seq_len}) must be a multiple of 4 for the curriculum (or --curriculum 0)"
            )
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup < 1:
            raise ValueError("--lr must be positive, min_lr_ratio in [0, 1], warmup in [0, 1)")

    @property
    def accum_steps(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup * self.steps)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def seq_len_at(self, step: int) -> int:
        """The curriculum: seq_len // 4 for the first `curriculum` fraction of steps, then seq_len. Tokens per step
        stay constant (a short phase packs 4x the rows), as K3 kept its batch in tokens across 8K -> 64K."""
        return self.seq_len // 4 if step < int(self.curriculum * self.steps) else self.seq_len

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_file(cls, path: str) -> TrainConfig:
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    def save(self, run_dir: str) -> None:
        os.makedirs(run_dir, exist_ok=True)
        tmp = os.path.join(run_dir, ".train_config.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.replace(tmp, os.path.join(run_dir, "train_config.json"))
