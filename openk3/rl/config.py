"""RLConfig: every setting of a `k3 rl` run, one dataclass, mapped 1:1 from its flags (train/flags.py builds them).

Defaults are sized for a tiny policy on 2 CPU cores: 8 groups of 8 samples per step, PPO clip with K3's open
stacks' asymmetric band (0.2 / 0.28), IcePop masking of tokens whose trainer/rollout ratio leaves [0.5, 5], routing
replay on, synchronous (no off-policy steps) and no partial rollouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import ClassVar

from openk3.config import TEXT_PRESETS
from openk3.train.config import flag

LOSS_KINDS = ("ppo", "cispo", "k15", "reinforce")
CORRECTIONS = ("none", "tis", "icepop")
AVERAGES = ("token", "sequence")
FRESH_COPY_STEPS = 400  # the copy phase change came at 200-280 steps in our runs (sft.py); with margin


@dataclass
class RLConfig:
    CONFIG_FILE: ClassVar[str] = "rl_config.json"  # where `save` writes the run's settings (read on --resume)

    task: str = flag("calculator,files", "task families, comma-separated: calculator, files, code-fix")
    out: str = flag("runs/rl", "run folder: checkpoints, metrics.jsonl, rl_config.json", required=True)
    steps: int = flag(100, "RL steps (rollout -> update -> publish)")
    stop_after: int | None = flag(None, "stop cleanly once this many steps are done", launch=True)
    resume: bool = flag(False, "continue the run in --out up to --steps")
    seed: int = flag(0, "seed for weights, task order and sampling")
    init: str | None = flag(None, "start from this checkpoint (folder or run) instead of a fresh tiny model; it must "
                            "speak XTML")  # fmt: skip
    preset: str = flag("tiny", "model preset of a fresh policy", choices=TEXT_PRESETS)
    copy_steps: int | None = flag(None, "copy pre-training steps before SFT (short spans of the tasks' text, each "
                                  "repeated: teaches a fresh tiny policy to copy, which SFT on whole episodes is slow "
                                  "to); default: 400 for a fresh policy with --sft-steps, else 0")  # fmt: skip
    sft_steps: int = flag(0, "SFT warm-start steps on generated demonstrations before RL")
    sft_batch_size: int = flag(16, "demonstrations per SFT step")
    sft_lr: float = flag(2e-3, "SFT learning rate")
    sft_guess_share: float = flag(0.0, "share of SFT demonstrations replaced by tool-free guesses (an answer given "
                                  "without looking), so the warm start calls its tools only part of the time")  # fmt: skip
    groups_per_step: int = flag(8, "tasks per RL step (round-robin over the families)")
    group_size: int = flag(8, "samples per task (the GRPO group)")
    lr: float = flag(1e-4, "RL learning rate (AdamW); 3e-4 made the tiny policy drift to repeated tool calls "
                     "(benchmarks/results/rl-cpu.md)")  # fmt: skip
    lr_decay_steps: int = flag(0, "decay the rate linearly over the last N of --steps, so the last step runs at "
                               "--lr-min-ratio x --lr (constant before; 0: constant throughout). A function of the "
                               "step: a resumed run follows the same schedule")  # fmt: skip
    lr_min_ratio: float = flag(0.1, "the rate of the last step as a share of --lr, with --lr-decay-steps")
    weight_decay: float = flag(0.0, "AdamW weight decay on matrices")
    grad_clip: float = flag(1.0, "global gradient-norm clip")
    loss: str = flag("ppo", "policy loss: ppo (asymmetric clip), cispo, k15 (Kimi k1.5 mirror descent), reinforce",
                     choices=LOSS_KINDS)  # fmt: skip
    eps_low: float = flag(0.2, "PPO clip below")
    eps_high: float = flag(0.28, "PPO clip above")
    average: str = flag("token", "loss averaging: token (over all tokens) or sequence", choices=AVERAGES)
    correction: str = flag("icepop", "off-policy correction between trainer and rollout log-probs", choices=CORRECTIONS)
    micro_batch_tokens: int = flag(4096, "tokens per forward/backward of an update (gradients accumulate to the "
                                   "same update; bounds the trainer's peak memory)")  # fmt: skip
    kl_coef: float = flag(0.0, "KL to the reference (the policy at the start of RL); 0 disables")
    normalize_std: bool = flag(False, "divide group advantages by the group's reward std")
    gap_check_every: int = flag(10, "measure the rollout-vs-train log-prob gap the other way too (without routing "
                                "replay when it is on, with it when off: one extra no-grad forward over the batch, "
                                "about a quarter of the update) on step 1 and every N steps after; 0 never")  # fmt: skip
    routing_replay: bool = flag(True, "train with the rollout's routed experts (R3); --no-routing-replay recomputes "
                                "routes", both=True)  # fmt: skip
    max_off_policy_steps: int = flag(0, "bounded staleness: rollouts may use weights up to K updates old; "
                                     "trajectories with older tokens are dropped (0 = synchronous)")  # fmt: skip
    partial_rollout_fraction: float = flag(1.0, "λ: stop a step's generation once this fraction of its "
                                           "trajectories finished; the rest continue next step (needs "
                                           "--max-off-policy-steps >= 1 when < 1)")  # fmt: skip
    max_turns: int = flag(4, "assistant turns per episode")
    max_tokens: int = flag(256, "generated tokens per episode")
    max_tokens_per_turn: int = flag(96, "generated tokens per turn")
    eval_every: int = flag(10, "held-out evaluation every N steps (and at the start and end)")
    eval_tasks: int = flag(32, "held-out tasks per family per evaluation (greedy)")
    save_every: int = flag(25, "checkpoint every N steps and at the end")
    keep_checkpoints: int = flag(2, "complete checkpoints to keep")
    max_nonfinite: int = flag(5, "stop (saving the last good weights) after this many non-finite steps in a row; "
                              "each one is skipped")  # fmt: skip
    prefix_caching: bool = flag(True, "prefix caching in the rollout engine (turns resume from the previous turn)")
    device: str = flag("auto", "auto (cuda when available), cpu, cuda, cuda:1, ...: the trainer and the engine",
                       launch=True)  # fmt: skip
    precision: str = flag("fp32", "fp32, bf16 (autocast) or auto (bf16 on CUDA when supported): the update",
                          choices=("fp32", "bf16", "auto"))  # fmt: skip
    dp: int | None = flag(None, "data-parallel degree of the update (FSDP2); default: the processes not taken by "
                          "--ep and --cp", launch=True)  # fmt: skip
    ep: int = flag(1, "expert-parallel degree of the update (experts split over ranks, all-to-all dispatch)",
                   launch=True)  # fmt: skip
    cp: int = flag(1, "context-parallel degree of the update (each trajectory's positions split over ranks)",
                   launch=True)  # fmt: skip
    max_num_batched_tokens: int = flag(4096, "the rollout engine's token budget per step")
    cache_memory_mb: int = flag(256, "the rollout engine's KV/state cache memory, MiB")
    max_model_len: int = flag(2048, "the rollout engine's longest sequence (prompt + episode), tokens")
    progress: bool = flag(True, "no progress bar", launch=True)
    threads: int | None = flag(None, "torch CPU threads per process", launch=True)

    def __post_init__(self) -> None:
        if self.copy_steps is None:
            self.copy_steps = FRESH_COPY_STEPS if self.init is None and self.sft_steps > 0 else 0
        self.validate()

    @property
    def families(self) -> list[str]:
        return [name.strip() for name in self.task.split(",") if name.strip()]

    def validate(self) -> None:
        from openk3.rl.envs import FAMILIES

        unknown = [name for name in self.families if name not in FAMILIES]
        if not self.families or unknown:
            raise ValueError(f"--task: unknown task family {unknown or self.task!r}; choose from {sorted(FAMILIES)}")
        positive = ("steps", "groups_per_step", "group_size", "max_turns", "max_tokens", "max_tokens_per_turn",
                    "eval_every", "eval_tasks", "save_every", "sft_batch_size", "micro_batch_tokens", "ep", "cp",
                    "max_num_batched_tokens", "cache_memory_mb", "max_model_len", "max_nonfinite")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("copy_steps", "sft_steps", "max_off_policy_steps", "kl_coef", "weight_decay", "gap_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.dp is not None and self.dp <= 0:
            raise ValueError(f"--dp must be positive, got {self.dp}")
        if self.lr <= 0 or self.sft_lr <= 0:
            raise ValueError("--lr and --sft-lr must be positive")
        if not 0 <= self.lr_decay_steps <= self.steps:
            raise ValueError(f"--lr-decay-steps must be in [0, --steps={self.steps}], got {self.lr_decay_steps}")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"--lr-min-ratio must be in [0, 1], got {self.lr_min_ratio}")
        if not 0 <= self.sft_guess_share <= 1:
            raise ValueError(f"--sft-guess-share must be in [0, 1], got {self.sft_guess_share}")
        if not 0 < self.partial_rollout_fraction <= 1:
            raise ValueError(f"--partial-rollout-fraction must be in (0, 1], got {self.partial_rollout_fraction}")
        if self.partial_rollout_fraction < 1 and self.max_off_policy_steps < 1:
            raise ValueError("--partial-rollout-fraction < 1 continues trajectories with the next step's weights, so "
                             "they carry tokens one version old: pass --max-off-policy-steps 1 or more")  # fmt: skip
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {choices}, got {getattr(self, f.name)!r}"
                )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_file(cls, path: str) -> RLConfig:
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    def save(self, run_dir: str) -> None:
        os.makedirs(run_dir, exist_ok=True)
        tmp = os.path.join(run_dir, f".{self.CONFIG_FILE}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.replace(tmp, os.path.join(run_dir, self.CONFIG_FILE))
