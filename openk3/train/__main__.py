"""`python -m openk3.train ...`: the training entry point for torchrun (`k3 train` flags plus --dp/--ep/--cp).

    torchrun --standalone --nproc-per-node 4 -m openk3.train --preset tiny --out runs/tiny-4 --dp 2 --ep 2

With one process (no torchrun) it is plain `k3 train`: the same Trainer, at a world of 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from openk3.parallel.watchdog import bound_subgroup_timeouts, collective_watchdog
from openk3.train.flags import add_train_arguments, config_from_args
from openk3.train.trainer import Trainer
from openk3.utils import set_threads

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openk3.train", description="train a K3 model (torchrun-aware)")
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The processes on this machine share its cores (torchrun sets OMP_NUM_THREADS=1 unless it is set; `k3 train
    # --nproc N` sets it to the cores / N).
    threads = set_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"k3 train: {threads}", file=sys.stderr)
    if world == 1:  # a world of 1 needs no process group
        trainer = Trainer(cfg)
        trainer.run()
        return 0 if trainer.stopped_by is None else 128 + trainer.stopped_by  # the shell convention after a signal
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        cfg.device = f"cuda:{local}"
    else:
        cfg.device = "cpu"
    # A collective that never completes (ranks disagreeing on what to call next) ends the run after this many
    # seconds with an error naming this rank, its step and the collective it waited in (parallel/watchdog.py).
    timeout_s = float(os.environ.get("OPENK3_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    bound_subgroup_timeouts(timedelta(seconds=timeout_s))
    trainer: Trainer | None = None

    def where() -> str:
        if trainer is None:
            return "while setting up (before step 1)"
        return f"in step {trainer.step + 1} (or the evaluation/checkpoint after step {trainer.step})"

    try:
        with collective_watchdog(where, timeout_s):
            trainer = Trainer(cfg)
            summary = trainer.run()  # the layout (dp x ep x cp) comes from the process group and cfg
        if dist.get_rank() == 0 and summary:
            print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float)))
    finally:
        dist.destroy_process_group()
    return 0 if trainer.stopped_by is None else 128 + trainer.stopped_by  # every rank stopped at the same step


if __name__ == "__main__":
    sys.exit(main())
