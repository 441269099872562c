"""The warm start of `k3 rl` and `k3 distill`: copy pre-training (a fresh policy learns to copy spans of its
context), then SFT on demonstrations, before RL. It is a phase of the run on the same training core (the `lm` loss):
it checkpoints every WARM_SAVE_EVERY steps and at the end of each phase, a run stopped inside it (Ctrl-C, SIGTERM)
resumes there, and RL then starts with fresh optimizer moments.
"""

from __future__ import annotations

import os
import time

import torch

from openk3.rl.sft import COPY_BATCH
from openk3.train.batch import TokenBatch
from openk3.train.checkpoint import TRAINER_STATE
from openk3.train.optim import param_groups
from openk3.utils import read_json, release_freed_memory

WARM_SAVE_EVERY = 100  # warm-start steps between checkpoints (and one at the end of each phase)


class WarmStart:
    """The warm-start phase of RLTrainer (rl/loop.py), which this mixes into: it trains the trainer's core on the
    trainer's copy and demonstration streams and saves and stops through the trainer."""

    def _warm_phase_left(self, ckpt: str | None) -> bool:
        """Whether the run (resumed from `ckpt`) is still in its warm start."""
        done = read_json(os.path.join(ckpt, TRAINER_STATE)) if ckpt is not None else {}
        return done.get("copy_done", 0) < self.cfg.copy_steps or done.get("sft_done", 0) < self.cfg.sft_steps

    def _optimizer(self, warm: bool):
        """AdamW of the warm start (no weight decay, --sft-lr) or of RL; foreach off: a fixed update order."""
        cfg = self.cfg
        return torch.optim.AdamW(param_groups(self.model, 0.0 if warm else cfg.weight_decay),
                                 lr=cfg.sft_lr if warm else cfg.lr, betas=(0.9, 0.95), foreach=False)  # fmt: skip

    @property
    def optimizer(self):
        return self.core.optimizer

    def warm_start(self) -> None:
        """Copy pre-training (`copy_steps`, for a fresh policy: sft.CopyStream), then SFT on demonstrations
        (`sft_steps`), one AdamW, the `lm` loss on the core; each phase's progress is counted, so a resumed run
        skips what is done. RL then starts with fresh optimizer moments."""
        cfg = self.cfg
        t0 = time.perf_counter()
        # Constant rate for the copy phase: the induction phase change needs the full rate (sft.py).
        self.copy_done = self._supervised("copy", self.copy_done, cfg.copy_steps, lambda: self.copies.batch(COPY_BATCH),
                                          lambda f: 1.0)  # fmt: skip
        # Linear decay to a tenth: the last steps settle the policy RL starts from.
        if self.stopped_by is None:
            self.sft_done = self._supervised("sft", self.sft_done, cfg.sft_steps,
                                             lambda: self.demos.batch(cfg.sft_batch_size), lambda f: 1 - 0.9 * f)  # fmt: skip
        if self.stopped_by is not None:
            return
        self.core.optimizer = self._optimizer(warm=False)
        release_freed_memory()
        self._publish(force=True)
        self.log(f"{self.command}: warm start: {cfg.copy_steps} copy + {cfg.sft_steps} SFT steps in "
                 f"{time.perf_counter() - t0:.0f} s")  # fmt: skip

    def _supervised(self, phase: str, done: int, total: int, batch, schedule) -> int:
        """Steps of `phase` ("copy" or "sft") from `done` up to `total`: cross-entropy on each batch's masked tokens
        (every rank draws the same batch and trains on its share of its examples), the rate
        `sft_lr * schedule(done / total)`; a line in sft.jsonl every 20 steps and at the end. Returns the steps
        done."""
        cfg = self.cfg
        bar = progress_bar(total, done, cfg.progress and self.sync.is_main, f"{self.command}: {phase}")
        t0 = time.perf_counter()
        while done < total:
            examples = batch()
            lo, hi = self.sync.share(len(examples))
            mine = examples[lo:hi]
            mbs = [TokenBatch.from_sequences([ids for ids, _ in mine], [mask for _, mask in mine])] if mine else []
            mbs += [TokenBatch.padding_batch()] * (self.sync.max_over_ranks(len(mbs)) - len(mbs))
            out = self.core.step(mbs, "lm", cfg.sft_lr * schedule(done / total))
            n = sum(sum(mask[1:]) for _, mask in examples)
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}")
            setattr(self, f"{phase}_done", done)
            stopping = self._stopping()
            if done % WARM_SAVE_EVERY == 0 or done == total or stopping:  # a stopped warm start resumes in its phase
                path = self.save()
            if stopping:
                bar.close()
                self._report_stop(path)
                return done
            if done % 20 == 0 or done == total:
                self._write({f"{phase}_step": done, f"{phase}_loss": out["loss"], f"{phase}_tokens": n,
                             "elapsed_s": time.perf_counter() - t0}, metrics_file="sft.jsonl")  # fmt: skip
        bar.close()
        return done


def progress_bar(total: int, initial: int, enabled: bool, desc: str):
    """k3 train's progress bar, named after the command and the phase."""
    from openk3.train.trainer import _progress as train_progress

    bar = train_progress(total, initial, enabled)
    if enabled:
        bar.set_description(desc)
    return bar
