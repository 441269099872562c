"""The teachers of multi-teacher distillation: a registry keyed by (domain, thinking effort), parsed from `k3 distill
--teachers domain[:effort]=CKPT,...`, each an openk3 checkpoint with the student's vocabulary.

    registry = TeacherRegistry(parse_teachers("calculator=runs/t-calc,files:low=runs/t-lo"), tokenizer, text_config)
    with registry.use(TeacherKey("files", "low")) as teacher:   # a K3ForCausalLM, eval, no gradients
        ...

Residency ("memory" or "turn"): all teachers loaded once and kept (K3 at scale cannot; a tiny recipe can), or each
loaded from disk when its tokens are scored and dropped afterwards (memory bounded by one teacher; costs a load per
use, counted in `load_s`). Every teacher's vocabulary is checked when the registry is built, before anything loads
weights: a different tokenizer (by content fingerprint) or vocabulary size is a `VocabularyMismatch` naming the
teacher, since a per-token log-ratio between two vocabularies compares unrelated ids.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from openk3.data.xtml import THINKING_EFFORTS

RESIDENCIES = ("memory", "turn")


@dataclass(frozen=True, order=True)
class TeacherKey:
    domain: str  # a task family
    effort: str | None = None  # low / high / max; None: the domain is distilled without an effort tag

    def __str__(self) -> str:
        return self.domain if self.effort is None else f"{self.domain}:{self.effort}"

    @property
    def thinking(self) -> bool:
        """Effort-tagged episodes think (the release renders the effort only with thinking on)."""
        return self.effort is not None


def top_efforts(keys) -> dict[str, str]:
    """{domain: its highest effort among `keys`} for the effort-tagged domains: the effort b0 is measured at (the
    distillation's budget) and the one the recipe's cold start mostly thinks at."""
    top: dict[str, str] = {}
    for key in keys:
        if key.effort is not None:
            top[key.domain] = max(top.get(key.domain, key.effort), key.effort, key=THINKING_EFFORTS.index)
    return top


class VocabularyMismatch(ValueError):
    """A teacher whose tokenizer or vocabulary size differs from the student's."""


def parse_teachers(spec: str) -> dict[TeacherKey, str]:
    """`domain[:effort]=CKPT,...` -> {TeacherKey: checkpoint}. Errors name the offending item."""
    from openk3.rl.envs import FAMILIES

    out: dict[TeacherKey, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not path.strip() or not name.strip():
            raise ValueError(f"--teachers: {item!r} is not domain[:effort]=CHECKPOINT")
        domain, _, effort = (p.strip() for p in name.partition(":"))
        if domain not in FAMILIES:
            raise ValueError(f"--teachers: {item!r}: unknown domain {domain!r}; the domains are {sorted(FAMILIES)}")
        if effort and effort not in THINKING_EFFORTS:
            raise ValueError(
                f"--teachers: {item!r}: unknown effort {effort!r}; the efforts are {list(THINKING_EFFORTS)}"
            )
        key = TeacherKey(domain, effort or None)
        if key in out:
            raise ValueError(f"--teachers: {key} is given twice")
        out[key] = path.strip()
    if not out:
        raise ValueError("--teachers: no teacher given (domain[:effort]=CHECKPOINT,...)")
    for domain in {k.domain for k in out}:
        tagged = {k.effort is not None for k in out if k.domain == domain}
        if len(tagged) > 1:
            raise ValueError(f"--teachers: domain {domain!r} has teachers with and without an effort; give every one "
                             "of its teachers an effort, or none")  # fmt: skip
    return out


class TeacherRegistry:
    def __init__(self, teachers: dict[TeacherKey, str], tokenizer, text_config, residency: str = "memory"):
        from openk3.config import K3Config
        from openk3.data.tokenizer import load_tokenizer
        from openk3.train.checkpoint import resolve_checkpoint

        if residency not in RESIDENCIES:
            raise ValueError(f"residency must be one of {RESIDENCIES}, got {residency!r}")
        self.residency = residency
        self.folders: dict[TeacherKey, str] = {}
        for key, path in sorted(teachers.items()):
            if not os.path.exists(path):
                raise FileNotFoundError(f"teacher {key}: no checkpoint at {path}")
            folder = resolve_checkpoint(path)
            config = K3Config.from_pretrained(folder).text_config
            if config.vocab_size != text_config.vocab_size:
                raise VocabularyMismatch(f"teacher {key} ({path}) has vocab_size {config.vocab_size}, the student "
                                         f"{text_config.vocab_size}: distillation needs one vocabulary")  # fmt: skip
            theirs = load_tokenizer(folder, config)
            if theirs.fingerprint != tokenizer.fingerprint:
                raise VocabularyMismatch(f"teacher {key} ({path}) has another tokenizer than the student "
                                         f"({theirs.fingerprint[:16]} vs {tokenizer.fingerprint[:16]}): "
                                         "distillation needs one vocabulary")  # fmt: skip
            self.folders[key] = folder
        self.keys = sorted(self.folders)
        self.loads, self.load_s = 0, 0.0
        self._resident = {key: self._load(key) for key in self.keys} if residency == "memory" else {}

    def _load(self, key: TeacherKey):
        from openk3.train.checkpoint import load_model

        t0 = time.perf_counter()
        model, _ = load_model(self.folders[key], dtype=torch.float32)
        model.eval().requires_grad_(False)
        self.loads += 1
        self.load_s += time.perf_counter() - t0
        return model

    @contextlib.contextmanager
    def use(self, key: TeacherKey):
        """The teacher of `key` for the block: the resident one, or loaded now and dropped after."""
        if key not in self.folders:
            raise KeyError(f"no teacher for {key}; the teachers are {', '.join(map(str, self.keys))}")
        if key in self._resident:
            yield self._resident[key]
            return
        model = self._load(key)
        try:
            yield model
        finally:
            del model

    def resident(self, key: TeacherKey):
        """The teacher kept in memory (loading it once if the registry loads in turn): for its sampling engine."""
        if key not in self._resident:
            self._resident[key] = self._load(key)
        return self._resident[key]
