"""Shared pieces of the trainer tests: the corpus fixture and a small config on it (a module, not a conftest: tests
import `conftest` by name, so a second one would shadow tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from openk3.train.config import TrainConfig

QUIET = dict(progress=False, sample_tokens=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus: openk3/model's source files as .txt."""
    root = tmp_path_factory.mktemp("corpus")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "openk3", "model")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            with open(os.path.join(src, name), encoding="utf-8") as f:
                (root / f"{name}.txt").write_text(f.read(), encoding="utf-8")
    return str(root)


def small_config(corpus: str, out, **overrides) -> TrainConfig:
    """A tiny-preset run on `corpus`: byte tokenizer, 4 x 64-token batches, quiet; `overrides` set the rest."""
    return TrainConfig(**{**dict(data=corpus, tokenizer="byte", batch_size=4, seq_len=64, out=str(out), **QUIET),
                          **overrides})  # fmt: skip


def capture_grads(owner) -> dict:
    """A dict that `owner`'s next optimizer steps fill with the gradients they apply (`owner.optimizer`, over
    `owner.model`): the training core clears them after the step."""
    grads = {}
    real_step = owner.optimizer.step

    def capture():
        grads.update({n: p.grad.clone() for n, p in owner.model.named_parameters() if p.grad is not None})
        real_step()

    owner.optimizer.step = capture
    return grads


def grads_of_one_step(trainer):
    """Run one step, capturing the gradients the optimizer sees (Adam's first update amplifies rounding, so the
    gradients are the quantity to compare)."""
    grads = capture_grads(trainer)
    row = trainer.train_step()
    return row, grads
