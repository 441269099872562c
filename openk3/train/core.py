"""`TrainCore`: the one training step of every kind of training (pre-training, SFT, RL, distillation), and the
checkpoint around it. Drivers (train/trainer.py's pre-training loop, `k3 rl`, `k3 distill`) make the batches; the core
owns everything after that:

    step(micro_batches, loss, lr):
        1. the rate: `lr * lr_scale` into every parameter group
        2. each micro-batch (on a cp rank its piece of the positions: `Layout.local_tokens`): forward (bf16
           autocast when `precision` asks for it), the named loss from the registry
           (train/losses.py) divided by the step's totals (`Normalizers`, summed over micro-batches and ranks), then
           backward of loss x world (FSDP2 averages gradients over the ranks: this makes the sum)
        3. the step's loss summed over ranks; the gradient norm clipped by the layout (FSDP shards, EP experts)
        4. a non-finite loss or gradient norm skips the step (counted: `nonfinite_run`, `nonfinite_total`);
           otherwise quantile balancing (when the driver balances) and the optimizer step
        5. for policy losses, their metrics (ratio, clip fractions) recomputed once over the whole step's detached
           log-probs, gathered from every rank

The model is built and laid out by the caller (`Layout.parallelize`); one process is a world of 1. `save`/`load` are
the training checkpoint format (train/checkpoint.py: DCP, atomic, loadable at any layout) with the driver's own state
beside the core's counters.

Legend: T packed positions.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist

from openk3.train.batch import TokenBatch
from openk3.train.checkpoint import load_checkpoint, save_checkpoint
from openk3.train.distributed import Layout
from openk3.train.losses import WHOLE_STEP_METRICS, LossConfig, Normalizers, Scores, get_loss

PRECISIONS = ("fp32", "bf16", "auto")


class NonFiniteError(RuntimeError):
    """Raised by drivers when `max_nonfinite` steps in a row had a non-finite loss or gradient."""


def use_bf16(precision: str, device: torch.device) -> bool:
    """bf16 autocast: asked for, or `auto` on a CUDA device with bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


class TrainCore:
    def __init__(self, model, layout: Layout, optimizer, *, balancer, grad_clip: float = 1.0, precision: str = "fp32"):
        self.model, self.layout, self.optimizer, self.balancer = model, layout, optimizer, balancer
        self.grad_clip, self.precision = grad_clip, precision
        self.device = layout.device
        self.bf16 = use_bf16(precision, self.device)
        self.nonfinite_total, self.nonfinite_run, self.tokens_seen = 0, 0, 0
        # The detached log-probs of this rank's micro-batches (whole: a cp rank's gathered) at the last policy step.
        self.last_logp_T: torch.Tensor | None = None
        # The same over every data rank, in rank order, when the last step gathered them for its whole-step metrics
        # (drivers read it instead of gathering again); None otherwise.
        self.step_logp_T: torch.Tensor | None = None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def _logits(self, mb: TokenBatch) -> torch.Tensor:
        if mb.model_inputs is not None:
            return self.model(**mb.model_inputs).logits.flatten(0, 1)
        return self.model.forward_batch(mb.forward_batch(self.device))

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # lr_scale: --vision-lr (optim.param_groups)

    def normalizers(self, micro_batches: list[TokenBatch]) -> Normalizers:
        """The step's loss tokens and sequences with one, over every micro-batch and rank."""
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            per_seq = [bool(part.any()) for part in mb.loss_mask_T.split(mb.lengths)]
            counts += torch.tensor([float(mb.loss_mask_T.sum()), float(sum(per_seq))], dtype=torch.float64,
                                   device=self.device)  # fmt: skip
        tokens, sequences = (self.layout.sum_over_ranks(counts) / self.layout.dims.cp).tolist()  # cp ranks: same rows
        return Normalizers(round(tokens), round(sequences))

    def step(self, micro_batches: list[TokenBatch], loss: str, lr: float, cfg: LossConfig | None = None,
             norm: Normalizers | None = None, balance: bool = False, probe=None) -> dict:  # fmt: skip
        """One optimizer step on this rank's `micro_batches` (every rank passes the same number of them; pad with
        TokenBatch.padding_batch()) with the registered loss `loss`. Returns: loss (the step's, summed over ranks),
        grad_norm (before clipping), skipped (non-finite), for the policy losses their whole-step metrics, when
        `balance` the balancer's ("balance"), and what `probe(model)` read of the gradients before clipping
        ("probe")."""
        fn, cfg = get_loss(loss), cfg or LossConfig()
        norm = norm or self.normalizers(micro_batches)
        self.set_lr(lr)
        whole_step = loss in WHOLE_STEP_METRICS
        keep_logp = loss != "lm"  # the driver's log-prob gap reads them (`last_logp_T`); lm never forms them
        # The loss is summed on the device in fp64 (each micro-batch's fp32 value exactly, in order) and read once
        # per step together with the gradient norm: one host sync per step, none per micro-batch.
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        logps = []
        for mb in micro_batches:
            local = self.layout.local_tokens(mb).to(self.device)  # a cp rank's piece of the positions
            with self.balancer.collecting() if balance else nullcontext(), self.autocast():
                scores = Scores(local.targets_T, self._logits(local))
                # padding: a zero that still reaches every parameter it ran through, so backward's collectives match
                value = scores.logits_TV.float().sum() * 0.0 if mb.padding else fn(scores, local, cfg, norm)[0]
            (value * float(self.layout.world)).backward()
            total += value.detach().double()
            if keep_logp and not mb.padding:
                logps.append(self.layout.whole_positions(scores.logp_T.detach(), local))
            del scores, value
        self.layout.sum_over_ranks(total)
        probed = probe(self.model) if probe is not None else None
        grad_norm = self.layout.clip_gradients(self.model, self.grad_clip)
        total_f, grad_norm_f = torch.stack([total, grad_norm.to(torch.float64)]).tolist()
        row = {"loss": total_f, "grad_norm": grad_norm_f, "skipped": False}
        if probe is not None:
            row["probe"] = probed
        if math.isfinite(total_f) and math.isfinite(grad_norm_f):
            if balance:
                row["balance"] = self.balancer.step()
            self.optimizer.step()
            self.nonfinite_run = 0
        else:
            if balance:
                self.balancer.discard()
            self.nonfinite_total += 1
            self.nonfinite_run += 1
            row["skipped"] = True
        self.optimizer.zero_grad(set_to_none=True)
        self.last_logp_T = torch.cat(logps) if logps else torch.zeros(0)
        self.step_logp_T = None
        if whole_step:
            row.update(self._whole_step_metrics(fn, micro_batches, cfg, norm))
        return row

    def _whole_step_metrics(self, fn, micro_batches: list[TokenBatch], cfg: LossConfig, norm: Normalizers) -> dict:
        """The loss's metrics over the whole step (every rank's positions, in rank order) from detached log-probs;
        its "loss" entry replaces the summed one (the same value, in one summation)."""
        real = [mb for mb in micro_batches if not mb.padding]
        whole = TokenBatch.cat(real) if real else None
        logp_T = self.last_logp_T
        if self.layout.world > 1:
            parts = [None] * self.layout.world
            mine = whole is not None and self.layout.is_data_leader  # a data rank's cp ranks hold the same rows
            dist.all_gather_object(parts, (whole.to(torch.device("cpu")), logp_T.cpu()) if mine else None)
            parts = [p for p in parts if p is not None]
            self.step_logp_T = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0)
            if not parts:
                return {}
            whole = TokenBatch.cat([p[0] for p in parts])
            logp_T = self.step_logp_T
        else:
            self.step_logp_T = logp_T
        if whole is None:
            return {}
        with torch.no_grad():
            _, metrics = fn(Scores(whole.targets_T, logp_T=logp_T.cpu()), whole, cfg, norm)
        return metrics

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, run_dir: str, step: int, state: dict, tokenizer=None, keep: int = 2) -> str:
        """checkpoints/step-N at this layout (every rank writes its shards); `state` is the driver's (JSON values)."""
        state = {**state, "nonfinite_total": self.nonfinite_total, "tokens_seen": self.tokens_seen}
        return save_checkpoint(run_dir, step, self.model, self.optimizer, self.balancer.state_dict(), state, tokenizer,
                               keep=keep, layout=self.layout)  # fmt: skip

    def load(self, ckpt: str) -> dict:
        """Weights, optimizer moments, balancing state and RNG from `ckpt` (saved at any layout); returns its state."""
        state = load_checkpoint(ckpt, self.model, self.optimizer, self.balancer, self.layout)
        self.nonfinite_total, self.tokens_seen = state.get("nonfinite_total", 0), state.get("tokens_seen", 0)
        return state
