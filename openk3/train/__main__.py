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

from openk3.train.flags import add_train_arguments, config_from_args
from openk3.train.trainer import Trainer

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openk3.train", description="train a K3 model (torchrun-aware)")
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:  # a world of 1 needs no process group
        Trainer(cfg).run()
        return 0
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        cfg.device = f"cuda:{local}"
    else:
        cfg.device = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    # A collective that never completes (ranks disagreeing on what to call next) ends the run with an error after
    # this many seconds instead of hanging forever; TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatched collectives.
    timeout = timedelta(seconds=float(os.environ.get("OPENK3_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    try:
        summary = Trainer(cfg).run()  # the layout (dp x ep x cp) comes from the process group and cfg
        if dist.get_rank() == 0 and summary:
            print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float)))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
