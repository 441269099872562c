"""`python -m openk3.rl [distill] ...`: the `k3 rl` and `k3 distill` entry point for torchrun (every rank a rollout
worker and a rank of the sharded update, laid out by --dp x --ep).

    torchrun --standalone --nproc-per-node 2 -m openk3.rl --task calculator --out runs/rl-2 --steps 50 --ep 2
    torchrun --standalone --nproc-per-node 2 -m openk3.rl distill --teachers ... --out runs/distill-2

With one process (no torchrun) it is plain `k3 rl` / `k3 distill`.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from openk3.rl.config import RLConfig
from openk3.train.__main__ import DEFAULT_COLLECTIVE_TIMEOUT_S
from openk3.train.distributed import bound_subgroup_timeouts, collective_watchdog
from openk3.train.flags import add_train_arguments, config_from_args
from openk3.utils import set_threads


def build_parser(prog: str = "python -m openk3.rl", config_class=RLConfig) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="agentic RL of a K3 policy in sandboxes")
    add_train_arguments(parser, config_class)
    return parser


def run(cfg: RLConfig, log=print) -> dict:
    """Run `cfg` (an RLConfig, or a DistillConfig for `k3 distill`) in this process, or as one rank of the torchrun
    world it was launched in; returns the last metrics row (rank 0's)."""
    from openk3.rl.distill import DistillConfig, DistillTrainer
    from openk3.rl.loop import RLTrainer
    from openk3.train.trainer import resolve_device

    distill = isinstance(cfg, DistillConfig)
    command = "k3 distill" if distill else "k3 rl"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    threads = set_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if int(os.environ.get("RANK", "0")) == 0:
        detail = f"; method {cfg.method}; teachers {', '.join(map(str, sorted(cfg.teacher_specs)))}" if distill else ""
        log(f"{command}: {threads}{detail}")
    if world > 1:
        use_cuda = resolve_device(cfg.device).type == "cuda"
        if use_cuda:  # one GPU per process
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            cfg.device = f"cuda:{local}"
        # A collective that never completes (ranks disagreeing on what to call next) ends the run after this many
        # seconds with an error naming this rank, its step and the collective it waited in (parallel/watchdog.py).
        timeout = timedelta(seconds=float(os.environ.get("OPENK3_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S)))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
        bound_subgroup_timeouts(timeout)
    trainer, last = None, {}

    def where() -> str:
        return "while setting up" if trainer is None else f"in step {trainer.step + 1} (or the warm start before it)"

    try:
        with collective_watchdog(where, timeout.total_seconds()) if world > 1 else nullcontext():
            trainer = (DistillTrainer if distill else RLTrainer)(cfg, log=log)
            last = trainer.run()
        if trainer.sync.is_main and last.get("eval_success"):
            shown = ", ".join(f"{k} {v:.0%}" for k, v in last["eval_success"].items())
            log(f"{command}: final held-out success: {shown}")
    finally:
        if trainer is not None:
            trainer.close()
        if world > 1:
            dist.destroy_process_group()
    return last


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["distill"]:
        from openk3.rl.distill_config import CONFIG_FILE, DistillConfig

        args = build_parser("python -m openk3.rl distill", DistillConfig).parse_args(argv[1:])
        cfg = config_from_args(args, DistillConfig, CONFIG_FILE, "k3 distill")
    else:
        cfg = config_from_args(build_parser().parse_args(argv), RLConfig, RLConfig.CONFIG_FILE, "k3 rl")
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
