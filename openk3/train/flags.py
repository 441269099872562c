"""The `k3 train` flags, shared by `k3 train` and `python -m openk3.train` (the torchrun entry point): each flag
maps onto one TrainConfig field; a flag left out keeps the default, or on --resume the value the run started with.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from openk3.train.config import TrainConfig

# `k3 train` flags: (flag, TrainConfig field, type, help). Defaults live in TrainConfig; a flag left out keeps the
# default, or on --resume the value the run was started with.
TRAIN_FLAGS = [
    ("--preset", "preset", str, "model preset: tiny, small, k3"),
    (
        "--data",
        "data",
        str,
        "stdlib (default), mqar, needle, copy, recall, or a path: text file, folder, JSONL with 'text'",
    ),
    ("--tokenizer", "tokenizer", str, "bpe (trained on the corpus, saved with the checkpoint) or byte"),
    ("--steps", "steps", int, "total optimizer steps of the run (the schedule's length)"),
    ("--stop-after", "stop_after", int, "stop cleanly once this many steps are done (schedule unchanged)"),
    ("--seed", "seed", int, "seed for weights, data order and evaluation"),
    ("--balance", "balance", str, "router-bias balancing: quantile (K3), sign (DeepSeek-V3) or none"),
    ("--balance-bins", "balance_bins", int, "quantile-balancing histogram bins (K3: 1000)"),
    ("--balance-ema", "balance_ema", float, "damped QB update b = ema*b_old + (1-ema)*b_new (0: K3's rule)"),
    ("--batch-size", "batch_size", int, "global batch in sequences of the final length"),
    ("--micro-batch-size", "micro_batch_size", int, "sequences per forward/backward (gradient accumulation)"),
    ("--seq-len", "seq_len", int, "final sequence length of the curriculum"),
    ("--curriculum", "curriculum", float, "fraction of steps at seq_len // 4 before the full length (0 disables)"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--optimizer", "optimizer", str, "adamw, or muon (Muon for hidden matrices + AdamW for the rest; one process)"),
    ("--schedule", "schedule", str, "wsd (warmup-stable-decay) or cosine"),
    ("--warmup", "warmup", float, "warmup fraction of the steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay on matrices"),
    ("--grad-clip", "grad_clip", float, "global gradient-norm clip"),
    ("--device", "device", str, "auto, cpu, cuda, cuda:1, ..."),
    ("--precision", "precision", str, "auto (bf16 autocast on CUDA), fp32 or bf16"),
    ("--eval-every", "eval_every", int, "evaluate every N steps (and at the end)"),
    ("--eval-batches", "eval_batches", int, "validation batches per evaluation"),
    ("--save-every", "save_every", int, "checkpoint every N steps (and at the end)"),
    ("--keep-checkpoints", "keep_checkpoints", int, "complete checkpoints to keep"),
    ("--max-nonfinite", "max_nonfinite", int, "non-finite steps in a row before stopping"),
    ("--sample-tokens", "sample_tokens", int, "tokens of the sample printed after training (0: none)"),
    ("--dp", "dp", int, "data-parallel degree (FSDP2); dp x ep x cp = the number of processes"),
    ("--ep", "ep", int, "expert-parallel degree (experts split over ranks, all-to-all dispatch)"),
    ("--cp", "cp", int, "context-parallel degree (contiguous sequence shards)"),
]


def config_from_args(args) -> TrainConfig:
    given = {field: getattr(args, field) for _, field, _, _ in TRAIN_FLAGS if getattr(args, field) is not None}
    given.update(out=args.out, resume=args.resume, activation_checkpointing=args.activation_checkpointing or None,
                 balance_exact_thresholds=args.balance_exact_thresholds or None, progress=not args.no_progress)  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    saved_file = os.path.join(args.out, "train_config.json")
    if args.resume and os.path.exists(saved_file):
        saved = dataclasses.asdict(TrainConfig.from_file(saved_file))
        for key, value in given.items():
            if (
                key not in ("steps", "stop_after", "resume", "progress", "out", "dp", "ep", "cp")
                and saved.get(key) != value
            ):
                print(f"k3 train: note: --resume changes {key} from {saved.get(key)!r} to {value!r}", file=sys.stderr)
        for key in ("dp", "ep", "cp"):  # the layout belongs to this launch, not to the run
            saved[key] = given.get(key, 1)
        saved.update(given)
        saved["stop_after"] = given.get("stop_after")
        return TrainConfig(**saved)
    return TrainConfig(**given)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    for flag, field, typ, text in TRAIN_FLAGS:
        p.add_argument(flag, dest=field, type=typ, default=None, help=text)
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, train_config.json")
    p.add_argument("--resume", action="store_true", help="continue the run in --out up to --steps")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument(
        "--balance-exact-thresholds",
        action="store_true",
        help="quantile balancing with exact per-entry thresholds (spec §2.4 refinement, not K3's rule)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
