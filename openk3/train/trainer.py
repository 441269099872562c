"""The training loop: `Trainer(cfg).run()` trains a K3 model from a preset on a corpus or a synthetic task.

Per optimizer step (no argument parsing here; `k3 train` maps flags onto `TrainConfig`):
    1. the curriculum picks the sequence length; the step's token budget is cut into `accum_steps` micro-batches
    2. each micro-batch: forward under the balancer's `collecting()` (router statistics), summed cross-entropy
       divided by the step's labelled-token count, backward (so any micro-batch split gives the same gradient)
    3. gradient clipping; a non-finite loss or gradient norm skips the step (counted, logged; training stops with
       the last good checkpoint after `max_nonfinite` in a row)
    4. `Balancer.step()` updates the router biases (quantile balancing by default), then `optimizer.step()`
    5. one JSON line in metrics.jsonl; periodic evaluation and atomic checkpoints: every `save_every` steps, at the
       end, once early (step FIRST_SAVE_STEP, so a run stopped in its first minutes can be resumed) and at the next
       step boundary after SIGINT (Ctrl-C) or SIGTERM, which then ends the run cleanly (`stopped_by` names the
       signal; another one REPEAT_GRACE_S later stops at once, without saving). Every rank stops at the same step:
       the flag is all-reduced at each step boundary when the world is larger than 1.

One Trainer for every layout: one process is a world of 1, and what differs between layouts (mesh, EP/CP/FSDP2,
the rows each rank takes, the loss and gradient-norm reductions) is the `Layout` object (train/distributed.py).

Everything a resumed run needs (weights, AdamW moments, data position, balancing state, RNG, counters) is in the
checkpoint, so `--steps 2N` in one go equals `--stop-after N` followed by `--resume`, bit for bit; the checkpoint
is DCP (train/checkpoint.py), so the resumed half may run at another layout (same losses to the cross-layout
tolerance).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import torch

from openk3.config import K3Config
from openk3.data.packing import IGNORE_INDEX
from openk3.parallel.ac import apply_activation_checkpointing
from openk3.parallel.dims import ParallelDims
from openk3.train.balance import Balancer
from openk3.train.batch import TokenBatch
from openk3.train.checkpoint import FIRST_SAVE_STEP, OPTIMIZER_CHANGES, build_model, describe_changes, latest_checkpoint
from openk3.train.config import TrainConfig
from openk3.train.core import NonFiniteError, TrainCore
from openk3.train.data import RunData
from openk3.train.distributed import Layout
from openk3.train.evaluate import evaluate
from openk3.train.losses import Normalizers
from openk3.train.metrics import random_routing_maxvio_floor, tower_grad_norm
from openk3.train.optim import build_optimizer, lr_at
from openk3.train.throughput import matmul_gflops

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_GRACE_S = 2.0  # a stop signal repeated within this many seconds is the same request (see _StopSignals)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Trainer:
    """Trains at any layout: `layout` defaults to this process group's (a world of 1 without one), laid out by
    cfg.dp x cfg.ep x cfg.cp (train/distributed.py)."""

    def __init__(self, cfg: TrainConfig, log=print, layout: Layout | None = None):
        self.device = resolve_device(cfg.device)
        self.layout = layout or Layout(ParallelDims(cfg.dp, cfg.ep, cfg.cp), self.device)
        if not self.layout.is_main:  # one process reports; the others train silently
            cfg.progress, log = False, (lambda *args, **kwargs: None)
        self.cfg, self.log = cfg, log
        self.run_dir = cfg.out
        ckpt = self._checkpoint_to_resume()
        torch.manual_seed(cfg.seed)
        model_config = K3Config.from_pretrained(ckpt) if ckpt else K3Config.preset(cfg.preset)
        if cfg.vision:
            from openk3.train.vision_data import VisionRunData  # Pillow and the task renderer: vision runs only

            self.data = VisionRunData(cfg, model_config, tokenizer_dir=ckpt, log=log)
        else:
            self.data = RunData(cfg, model_config.text_config, tokenizer_dir=ckpt, log=log)
        self.model = build_model(model_config)
        if ckpt is None:
            self.model.init_weights(torch.Generator().manual_seed(cfg.seed))
        self.model.to(self.device).train()
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        self.layout.parallelize(self.model)
        self.optimizer = build_optimizer(self.model, cfg)
        self.balancer = Balancer(self.model, cfg.balance, num_bins=cfg.balance_bins, process_group=self.layout.data_group,
                                 exact_thresholds=cfg.balance_exact_thresholds, ema=cfg.balance_ema)  # fmt: skip
        self.core = TrainCore(self.model, self.layout, self.optimizer, balancer=self.balancer, grad_clip=cfg.grad_clip,
                              precision=cfg.precision)  # fmt: skip
        self.step = 0
        self.stopped_by: signal.Signals | None = None  # the signal that ended the last run(), if one did
        if ckpt is not None:  # weights, moments, balancing state and RNG, resharded to this layout
            state = self.core.load(ckpt)
            self.step = state["step"]
            self.data.load_state_dict(state["data"])
            log(f"resumed {self.run_dir} at step {self.step} from {ckpt}")
            changed = describe_changes(state[OPTIMIZER_CHANGES], skip=("lr",))  # the schedule sets lr every step
            if changed:  # e.g. a new --weight-decay
                log(f"this run's optimizer settings replace the checkpoint's: {changed}")
        if cfg.resume:
            self._truncate_metrics(self.step)
        if self.layout.is_main:
            cfg.save(self.run_dir)
        # The reported max_vio is a max over MoE layers, so its floor is too. A vision step's token count depends on
        # its images: its floor is computed at the first step, from that step's tokens.
        self.max_vio_floor = None if cfg.vision else self._max_vio_floor(cfg.tokens_per_step)
        self.peak_gflops = matmul_gflops(self.device)
        self.active_params = self.model.num_parameters()[1]

    def _max_vio_floor(self, tokens: int) -> float:
        text = self.model.text_config
        return random_routing_maxvio_floor(tokens, text.num_experts, text.num_experts_per_token, trials=16,
                                           seed=self.cfg.seed, num_layers=len(self.balancer.layers))  # fmt: skip

    def _checkpoint_to_resume(self) -> str | None:
        """The checkpoint `--resume` continues from: the run's newest good one (a damaged one is skipped with a
        warning), or None to start the run again from step 0 when it was stopped before its first save finished."""
        run, holds_run = self.run_dir, _holds_run(self.run_dir)
        if not self.cfg.resume:
            if not holds_run:
                return None
            if latest_checkpoint(run, warn=lambda _: None) is None:
                raise ValueError(
                    f"{run} holds a run with no complete checkpoint (it was stopped before its first save finished); "
                    f"pass --resume to start it again from step 0, or choose another --out"
                )
            raise ValueError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
        if not holds_run:
            raise ValueError(f"--resume: {run} holds no run to resume (no checkpoints/ or metrics.jsonl)")
        ckpt = latest_checkpoint(run, warn=lambda msg: self.log(f"warning: {msg}"))
        if ckpt is None:
            self.log(f"warning: --resume: {run}/checkpoints holds no complete checkpoint; starting the run again "
                     f"from step 0 (metrics.jsonl is cut back to match)")  # fmt: skip
        return ckpt

    # ---- one optimizer step ----------------------------------------------------------------------------------
    def _micro_batch(self, b) -> TokenBatch:
        """This process's share of micro-batch `b` as the core trains on it."""
        if self.cfg.vision:  # one process (TrainConfig.validate); labels are shifted already
            ids, labels = b.padded(self.model.text_config.pad_token_id)  # faster than packed here (vision_data.py)
            labels_T = labels.flatten()
            inputs = {"input_ids": ids.to(self.device), "pixel_values": b.pixel_values.to(self.device),
                      "grid_thws": b.grid_thws}  # fmt: skip
            return TokenBatch(labels_T, labels_T != IGNORE_INDEX, [labels_T.numel()], model_inputs=inputs)
        fb, labels, _ = self.layout.local_batch(b)
        labels_T = labels.reshape(-1)
        return TokenBatch(labels_T, labels_T != IGNORE_INDEX, fb.seq_lens, prebuilt=fb)

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        seq_len = cfg.seq_len_at(step)
        rows = cfg.batch_size if cfg.vision else cfg.tokens_per_step // seq_len
        micro_rows = rows // cfg.accum_steps
        lr = lr_at(step, cfg)
        start = time.perf_counter()
        batches = [self.data.next_train_batch(micro_rows, seq_len) for _ in range(cfg.accum_steps)]
        # Every rank draws the same global batches, so the label count needs no communication.
        norm = Normalizers(tokens=sum(b.num_loss_tokens() for b in batches), sequences=0)
        # The tower's gradient norm is measured before clipping, as grad_norm is.
        out = self.core.step([self._micro_batch(b) for b in batches], "lm", lr, norm=norm, balance=True,
                             probe=tower_grad_norm if cfg.vision else None)  # fmt: skip
        row = {"step": step + 1, "loss": out["loss"], "lr": lr, "seq_len": seq_len, "grad_norm": out["grad_norm"]}
        if "probe" in out:
            row.update(grad_norm_tower=float(out["probe"]))
        if out["skipped"]:
            row.update(skipped=True)
        else:
            bal = out["balance"]
            row.update(max_vio=bal["max_vio"], max_vio_per_layer=bal["max_vio_per_layer"],
                       near_tie_fraction_per_layer=bal["near_tie_fraction_per_layer"])  # fmt: skip
            self._last_loads = bal["loads"]
        elapsed = time.perf_counter() - start
        tokens = sum(b.num_tokens() for b in batches) if cfg.vision else rows * seq_len
        if self.max_vio_floor is None:
            self.max_vio_floor = self._max_vio_floor(tokens)
        self.core.tokens_seen += tokens
        tps = tokens / elapsed
        row.update(tokens_per_s=tps, tokens=self.core.tokens_seen, nonfinite_steps=self.core.nonfinite_total,
                   mfu=6 * self.active_params * tps / (self.peak_gflops * 1e9))  # fmt: skip
        self.step += 1
        return row

    @property
    def nonfinite_total(self) -> int:
        return self.core.nonfinite_total

    @property
    def nonfinite_run(self) -> int:
        return self.core.nonfinite_run

    # ---- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
        bar = _progress(total=cfg.steps, initial=self.step, enabled=cfg.progress)
        started = time.perf_counter()
        last_row: dict = {}
        self.stopped_by = None
        if cfg.contrastive_steps and self.step == 0:
            from openk3.train.contrastive import pretrain_tower

            pretrain_tower(self.model, self.data, cfg, self.device, log=self.log)
        signals = _StopSignals(self.log).install()
        try:
            while self.step < stop:
                row = self.train_step()
                if row.get("skipped"):
                    self.log(f"step {row['step']}: non-finite loss or gradient (loss {row['loss']}, grad norm "
                             f"{row['grad_norm']}); skipped ({self.nonfinite_run} in a row, {self.nonfinite_total} in all)")  # fmt: skip
                elif self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    row.update(self.evaluate())
                    if self.layout.rank == 0:  # every rank evaluates the same batches; one line is enough
                        _print_above(bar, self.log, _eval_line(row))
                row["elapsed_s"] = time.perf_counter() - started  # wall time of this invocation, evaluations included
                self._append_metrics(row)
                last_row = row
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}",
                                max_vio=f"{row.get('max_vio', float('nan')):.3f}")  # fmt: skip
                if self.nonfinite_run >= cfg.max_nonfinite:
                    path = self.save()  # the weights are those of the last good step: skipped steps change nothing
                    raise NonFiniteError(
                        f"{self.nonfinite_run} non-finite steps in a row (limit --max-nonfinite {cfg.max_nonfinite}); "
                        f"stopped at step {self.step} with the last good weights saved in {path}"
                    )
                stopping = self._agreed_stop(signals.received)
                if (self.step % cfg.save_every == 0 or self.step == stop or stopping
                        or (self.step == FIRST_SAVE_STEP < cfg.save_every)):  # fmt: skip
                    path = self.save()
                if stopping:
                    self.stopped_by = signals.received or signal.SIGTERM  # SIGTERM: another rank's signal
                    bar.close()
                    self.log(f"stopped by {self.stopped_by.name} at step {self.step} of {cfg.steps}; checkpoint "
                             f"saved in {path}; continue with: k3 train --out {self.run_dir} --resume")  # fmt: skip
                    break
        finally:
            signals.restore()
            bar.close()
        return last_row

    def _agreed_stop(self, received: signal.Signals | None) -> bool:
        """Whether to stop after this step: a stop signal reached this process or, on several ranks, any rank (one
        tiny all-reduce per step, so every rank saves and stops at the same step)."""
        if self.layout.world == 1:
            return received is not None
        flag = torch.tensor([0.0 if received is None else 1.0], device=self.device)
        return self.layout.sum_over_ranks(flag).item() > 0

    def evaluate(self) -> dict:
        self.model.eval()
        try:
            if self.cfg.vision:
                from openk3.train.vision_eval import evaluate_vision

                # The blank-image baseline doubles the evaluation's cost: the final evaluation only.
                out = evaluate_vision(self.model, self.data, self.device, blank=self.step >= self.cfg.steps)
            else:
                out = evaluate(self.model, self.data, self.cfg, self.device)
        finally:
            self.model.train()
        out["max_vio_floor"] = self.max_vio_floor
        if getattr(self, "_last_loads", None) is not None:
            out["expert_load"] = self._last_loads
        return out

    def save(self) -> str:
        """checkpoints/step-N at this layout: every rank writes its shards (train/checkpoint.py)."""
        return self.core.save(self.run_dir, self.step, {"data": self.data.state_dict()}, self.data.tokenizer,
                              keep=self.cfg.keep_checkpoints)  # fmt: skip

    # ---- metrics.jsonl -------------------------------------------------------------------------------------------
    @property
    def _metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    def _append_metrics(self, row: dict) -> None:
        if not self.layout.is_main:
            return
        with open(self._metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def _truncate_metrics(self, step: int) -> None:
        if self.layout.is_main:
            truncate_metrics(self._metrics_path, step)


class _StopSignals:
    """Between install() and restore(), SIGINT and SIGTERM are recorded in `received` for the loop to act on at the
    next step boundary; another one more than REPEAT_GRACE_S later raises KeyboardInterrupt at once. Handlers go in
    only in the main thread (Python allows no others); restore() puts the previous ones back."""

    def __init__(self, log=print):
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._previous: dict = {}
        self._log = log

    def install(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            # A repeat within REPEAT_GRACE_S is the same request arriving twice (under torchrun a terminal's Ctrl-C
            # reaches each worker directly and again through torchrun), not a second Ctrl-C.
            if time.monotonic() - self._first_at > REPEAT_GRACE_S:
                raise KeyboardInterrupt
            return
        self.received, self._first_at = signal.Signals(signum), time.monotonic()
        self._log(f"\n{self.received.name}: saving a checkpoint at the end of this step (again to stop at once)")

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _holds_run(run_dir: str) -> bool:
    """Whether `run_dir` holds a started run. (Not train_config.json: one process of a multi-process run may write it
    before another has looked.)"""
    return any(os.path.exists(os.path.join(run_dir, name)) for name in ("checkpoints", "metrics.jsonl"))


def truncate_metrics(path: str, step: int) -> None:
    """Drop the lines of metrics file `path` past `step` (written after the checkpoint a run resumes from) and a line
    cut short by a kill; the file is replaced atomically."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if _metrics_step(line) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(rows)
    os.replace(tmp, path)


def _metrics_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a line that is not a whole JSON row (so it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _eval_line(row: dict) -> str:
    """One line per evaluation, e.g. `step 50: val_loss 4.812 (unigram 5.770), mqar 12%, needle 0%`."""
    parts = [f"step {row['step']}: val_loss {row['val_loss']:.3f}"] if "val_loss" in row else [f"step {row['step']}:"]
    if "unigram_loss" in row:
        parts[0] += f" (unigram {row['unigram_loss']:.3f})"
    parts += [f"{name} {row[key]:.0%}" for key, name in (("mqar_acc", "mqar"), ("needle_acc", "needle")) if key in row]
    kinds = sorted(k[len("vision_exact_") :] for k in row if k.startswith("vision_exact_") and "blank" not in k)
    parts += [f"{kind} {row['vision_exact_' + kind]:.0%}" for kind in kinds]
    if "vision_exact_blank" in row:
        parts.append(f"blank-image baseline {row['vision_exact_blank']:.0%}")
    return ", ".join(parts)


def _print_above(bar, log, line: str) -> None:
    """A line above the progress bar (tqdm redraws the bar below it); plain `log` when there is no bar."""
    if hasattr(bar, "write") and log is print:
        bar.write(line)
    else:
        log(line)


def _progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; keep the loop usable without it
        enabled = False
    if not enabled:

        class _Silent:
            def update(self, n): ...
            def set_postfix(self, **kw): ...
            def close(self): ...

        return _Silent()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
