"""TrainConfig: every setting of a training run, one dataclass, mapped 1:1 from `k3 train` flags.

Derived values (micro-batch count, warmup steps, the curriculum's lengths) are computed here and nowhere else.
The model itself is configured by `openk3.config.K3Config` (a preset); this file only adds the run's settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

BALANCE_METHODS = ("quantile", "sign", "none")
SCHEDULES = ("wsd", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class TrainConfig:
    preset: str = "tiny"
    data: str = "stdlib"  # "stdlib", "mqar", "needle", "copy", "recall", or a path (text file, folder, JSONL with "text")
    tokenizer: str = "bpe"  # "bpe" (trained on the corpus, carried by the checkpoint) or "byte"
    steps: int = 200  # total optimizer steps of the run (the schedule's length)
    stop_after: int | None = None  # stop cleanly once the run has completed this many steps (schedule unchanged)
    resume: bool = False
    seed: int = 0
    out: str = "runs/tiny"
    balance: str = "quantile"
    balance_exact_thresholds: bool = False  # spec/balancing.md §2.4 refinement (not K3's rule); helps small k
    balance_bins: int = 1000  # quantile-balancing histogram bins (K3: 1000; more resolve near-tied scores better)
    balance_ema: float = 0.0  # spec/balancing.md §2.2's optional EMA: b = ema·b_old + (1 − ema)·b_new; 0 = K3's rule
    batch_size: int = 16  # global batch, in sequences of the final length
    micro_batch_size: int | None = None  # sequences per forward/backward; None = the whole batch
    seq_len: int = 256  # final sequence length of the curriculum
    curriculum: float = 0.5  # fraction of steps trained at seq_len // 4 (K3: 8K then 64K); 0 disables
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.05  # fraction of steps
    schedule: str = "wsd"
    decay_fraction: float = 0.2  # WSD: the final fraction of steps decays linearly to min_lr
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "adamw"  # "adamw" or "muon" (Muon for hidden matrices, AdamW for the rest; one process)
    beta1: float = 0.9
    beta2: float = 0.95
    device: str = "auto"
    precision: str = "auto"  # bf16 autocast on CUDA (when supported), fp32 on CPU, unless forced
    activation_checkpointing: bool = False
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 100
    keep_checkpoints: int = 2
    max_nonfinite: int = 5  # consecutive non-finite steps before training stops with a good checkpoint
    sample_tokens: int = 64  # printed sample after training; 0 disables
    progress: bool = True
    dp: int = 1  # parallel layout (openk3.parallel); dp x ep x cp = world size, under torchrun
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.steps <= 0:
            raise ValueError(f"--steps must be positive, got {self.steps}")
        if self.stop_after is not None and self.stop_after <= 0:
            raise ValueError(f"--stop-after must be positive, got {self.stop_after}")
        if self.balance not in BALANCE_METHODS:
            raise ValueError(f"--balance must be one of {BALANCE_METHODS}, got {self.balance!r}")
        if not 0.0 <= self.balance_ema < 1.0:
            raise ValueError(f"--balance-ema must be in [0, 1), got {self.balance_ema}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "muon" and self.dp * self.ep * self.cp > 1:
            raise ValueError("--optimizer muon runs in one process: its Newton-Schulz step needs whole matrices, which "
                             "FSDP2 and expert parallelism shard; use --optimizer adamw with --dp/--ep/--cp")  # fmt: skip
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.tokenizer not in ("bpe", "byte"):
            raise ValueError(f"--tokenizer must be 'bpe' or 'byte', got {self.tokenizer!r}")
        if self.batch_size <= 0 or self.seq_len <= 0:
            raise ValueError(f"--batch-size and --seq-len must be positive, got {self.batch_size}, {self.seq_len}")
        mb = self.micro_batch_size
        if mb is not None and (mb <= 0 or self.batch_size % mb):
            raise ValueError(f"--micro-batch-size ({mb}) must divide --batch-size ({self.batch_size})")
        if not 0 <= self.curriculum < 1:
            raise ValueError(f"--curriculum must be in [0, 1), got {self.curriculum}")
        if self.curriculum > 0 and self.seq_len % 4:
            raise ValueError(f"--seq-len ({self.seq_len}) must be a multiple of 4 for the curriculum (or --curriculum 0)")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup < 1:
            raise ValueError("--lr must be positive, min_lr_ratio in [0, 1], warmup in [0, 1)")

    @property
    def accum_steps(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.steps))

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
