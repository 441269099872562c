"""`python -m openk3.rl ...`: the `k3 rl` entry point for torchrun (every rank a rollout worker, rank 0 the trainer).

    torchrun --standalone --nproc-per-node 2 -m openk3.rl --task calculator --out runs/rl-2 --steps 50

With one process (no torchrun) it is plain `k3 rl`.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from openk3.rl.config import RLConfig
from openk3.train.flags import add_train_arguments, config_from_args
from openk3.utils import set_threads


def build_parser(prog: str = "python -m openk3.rl") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="agentic RL of a K3 policy in sandboxes")
    add_train_arguments(parser, RLConfig)
    return parser


def run(cfg: RLConfig) -> int:
    """Run `cfg` in this process, or as one rank of the torchrun world it was launched in."""
    from openk3.rl.loop import RLTrainer
    from openk3.rl.weight_sync import Sync

    world = int(os.environ.get("WORLD_SIZE", "1"))
    threads = set_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"k3 rl: {threads}", file=sys.stderr)
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    trainer = None
    try:
        trainer = RLTrainer(cfg, sync=Sync.from_process_group() if world > 1 else Sync.single())
        summary = trainer.run()
        if trainer.sync.is_main and summary.get("eval_success"):
            shown = ", ".join(f"{k} {v:.0%}" for k, v in summary["eval_success"].items())
            print(f"k3 rl: final held-out success: {shown}")
    finally:
        if trainer is not None:
            trainer.close()
        if world > 1:
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(config_from_args(args, RLConfig, "rl_config.json", "k3 rl"))


if __name__ == "__main__":
    sys.exit(main())
