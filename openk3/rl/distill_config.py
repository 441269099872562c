"""The settings of a `k3 distill` run (rl/distill.py): the RL run's settings (RLConfig) plus the teachers, the
method, the reward weights and the effort budget's τ schedule; mapped 1:1 from the command's flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from openk3.data.xtml import THINKING_EFFORTS
from openk3.rl.config import RLConfig
from openk3.rl.teachers import RESIDENCIES, TeacherKey, parse_teachers
from openk3.train.config import flag

METHODS = ("opd", "rl", "topk", "offpolicy")
OFFPOLICY_KEEP = ("all", "solved")
OFFPOLICY_WEIGHTS = ("tokens", "keys")
CONFIG_FILE = "distill_config.json"


@dataclass(frozen=True)
class TauSchedule:
    """τ_e(step): linear from `start` at step 0 to `final[e]` at `anneal_steps`, constant after."""

    start: float
    final: dict
    anneal_steps: int

    def __call__(self, effort: str, step: int) -> float:
        if effort not in self.final:
            raise KeyError(f"no final τ for effort {effort!r}; given for {sorted(self.final)}")
        f = 1.0 if self.anneal_steps <= 0 else min(max(step, 0) / self.anneal_steps, 1.0)
        return self.start + (self.final[effort] - self.start) * f


def parse_named_values(text: str, flag: str, names, form: str, convert, kind: str) -> dict:
    """`name=value,...` -> {name: convert(value)}, each name one of `names`; an error names the flag and the item
    (`form` says what an item should be, `kind` what a value should be)."""
    out = {}
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in names:
            raise ValueError(f"{flag}: {item!r} is not {form}")
        try:
            out[name.strip()] = convert(value)
        except ValueError:
            raise ValueError(f"{flag}: {item!r}: {value!r} is not {kind}") from None
    return out


def parse_tau_final(text: str) -> dict[str, float]:
    """`low=0.5,high=0.8,max=1.5` -> {"low": 0.5, ...}; errors name the item."""
    out = parse_named_values(text, "--tau-final", THINKING_EFFORTS,
                             f"effort=value with effort in {list(THINKING_EFFORTS)}", float, "a number")  # fmt: skip
    for name, tau in out.items():
        if tau <= 0:
            raise ValueError(f"--tau-final: {name}={tau:g}: τ must be positive")
    return out


def parse_offpolicy_draws(text: str, keys: list[str]) -> dict[str, int]:
    """`8` (every key) or `calculator=8,files:max=4` (the keys named; the rest none) -> {key: draws}; errors name
    the item."""
    text = text.strip()
    if text and "=" not in text:
        text = ",".join(f"{key}={text}" for key in keys)
    return parse_named_values(text, "--offpolicy-draws", keys, f"key=N with key one of the teachers' {keys}", int,
                              "a whole number")  # fmt: skip


@dataclass
class DistillConfig(RLConfig):
    CONFIG_FILE: ClassVar[str] = CONFIG_FILE

    teachers: str = flag("", "teachers: domain[:effort]=CKPT,... (a checkpoint folder or a k3 rl/train run each, "
                         "with the student's vocabulary)", required=True)  # fmt: skip
    task: str = flag("", "derived from --teachers (the teachers' domains); leave unset")
    out: str = flag("runs/distill", "run folder: checkpoints, metrics.jsonl, distill_config.json", required=True)
    method: str = flag("opd", "opd (Eq. 15 sampled-token reward), rl (task reward only), topk (forward KL to the "
                       "teacher's top-k distribution), offpolicy (SFT on teacher samples)", choices=METHODS)  # fmt: skip
    opd_weight: float = flag(1.0, "weight of the per-token distillation reward")
    task_weight: float = flag(0.0, "weight of the task reward (group advantage); --method rl uses 1 when this is 0")
    budget_weight: float = flag(1.0, "weight of the effort budget reward (−1 above τ·b0)")
    r_max: float = flag(5.0, "R_max: the per-token reward is clipped to ±R_max")
    topk: int = flag(8, "teacher tokens per position of --method topk")
    teacher_temperature: float = flag(1.0, "the teacher's distribution is softmax(logits / this) when it scores "
                                      "(opd), gives its top-k (topk) or samples (offpolicy); 1 is Eq. 15")  # fmt: skip
    offpolicy_keep: str = flag("all", "offpolicy: train on all teacher samples, or only on those that solve their "
                               "task (rejection sampling)", choices=OFFPOLICY_KEEP)  # fmt: skip
    offpolicy_weight: str = flag("tokens", "offpolicy: every kept teacher token weighs the same in a step's loss "
                                 "(tokens), or each teacher key's tokens together weigh the same (keys), so a domain "
                                 "of short answers is not outweighed by long ones", choices=OFFPOLICY_WEIGHTS)  # fmt: skip
    offpolicy_draws: str = flag("", "offpolicy with --offpolicy-keep solved: the teacher samples N episodes of "
                                "each task (N, for every key, or key=N,...) and the first --group-size that solve "
                                "it are kept (best of N rather than of --group-size); default: --group-size")  # fmt: skip
    residency: str = flag("memory", "teachers kept in memory, or loaded in turn for each scoring", choices=RESIDENCIES)
    tau_start: float = flag(3.0, "τ of every effort at step 0")
    tau_final: str = flag("low=0.5,high=0.8,max=1.5", "τ per effort after annealing")
    tau_anneal_steps: int = flag(20, "steps over which τ anneals linearly from --tau-start to --tau-final")

    def __post_init__(self) -> None:
        self.task = ",".join(sorted({k.domain for k in parse_teachers(self.teachers)}))
        super().__post_init__()

    @property
    def teacher_specs(self) -> dict[TeacherKey, str]:
        return parse_teachers(self.teachers)

    @property
    def draws(self) -> dict[str, int]:
        """Teacher samples per task of each key (str(TeacherKey)) in an offpolicy step."""
        given = parse_offpolicy_draws(self.offpolicy_draws, [str(k) for k in self.teacher_specs])
        return {str(k): given.get(str(k), self.group_size) for k in self.teacher_specs}

    @property
    def tau(self) -> TauSchedule:
        return TauSchedule(self.tau_start, parse_tau_final(self.tau_final), self.tau_anneal_steps)

    def validate(self) -> None:
        super().validate()
        for name in ("opd_weight", "task_weight", "budget_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("r_max", "tau_start", "topk", "teacher_temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        efforts = {k.effort for k in self.teacher_specs if k.effort is not None}
        missing = efforts - set(parse_tau_final(self.tau_final))
        if missing:
            raise ValueError(f"--tau-final gives no τ for effort {sorted(missing)}")
        if self.uses_budget and self.init is None:
            raise ValueError("the effort budget measures b0 with the cold-start model: pass --init CKPT (or "
                             "--budget-weight 0)")  # fmt: skip
        if self.offpolicy_keep != "all" and self.method != "offpolicy":
            raise ValueError(f"--offpolicy-keep {self.offpolicy_keep} filters teacher samples: it needs --method "
                             f"offpolicy, not {self.method}")  # fmt: skip
        if self.offpolicy_weight != "tokens" and self.method != "offpolicy":
            raise ValueError(f"--offpolicy-weight {self.offpolicy_weight} weighs teacher samples: it needs --method "
                             f"offpolicy, not {self.method}")  # fmt: skip
        if self.offpolicy_draws.strip():
            if self.method != "offpolicy" or self.offpolicy_keep != "solved":
                raise ValueError("--offpolicy-draws keeps the solved ones of more teacher samples: it needs --method "
                                 "offpolicy --offpolicy-keep solved")  # fmt: skip
            few = {k: n for k, n in self.draws.items() if n < self.group_size}
            if few:
                raise ValueError(f"--offpolicy-draws must be >= --group-size {self.group_size}, got {few}")
        if self.method == "offpolicy" and self.partial_rollout_fraction < 1:
            raise ValueError(
                "--method offpolicy trains on whole teacher episodes: --partial-rollout-fraction must be 1"
            )

    @property
    def uses_budget(self) -> bool:
        """The effort budget applies: an RL-style method, a budget weight, and an effort-tagged teacher."""
        return (self.method in ("opd", "rl") and self.budget_weight > 0
                and any(k.effort is not None for k in self.teacher_specs))  # fmt: skip

    @property
    def weights(self) -> tuple[float, float, float]:
        """(opd, task, budget) weights of the method."""
        if self.method == "rl":
            return 0.0, self.task_weight or 1.0, self.budget_weight
        return self.opd_weight, self.task_weight, self.budget_weight
