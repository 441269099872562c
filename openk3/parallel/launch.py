"""`k3 train/rl/distill --nproc N`: the same command on N processes of this machine, through torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

from openk3.utils import pick_threads


def torchrun_argv(nproc: int, argv: list[str], command: str = "train", module: str = "openk3.train",
                  module_args: list[str] = ()) -> list[str]:  # fmt: skip
    """`k3 train --nproc N ...` = `torchrun --standalone --nproc-per-node N -m openk3.train ...` with the same flags
    but --nproc (`argv`: k3's arguments, `command` first); `k3 rl` likewise with `-m openk3.rl`, `k3 distill` with
    `-m openk3.rl distill`."""
    argv = argv[argv.index(command) + 1 :]
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *module_args, *rest]  # fmt: skip


def launch_torchrun(nproc: int, argv: list[str], command: str = "train", module: str = "openk3.train",
                    module_args: list[str] = ()) -> int:  # fmt: skip
    """Run `torchrun_argv(...)` and return its exit code."""
    # torchrun would set OMP_NUM_THREADS=1 per process; the processes share the cores instead (--threads still wins).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(pick_threads(None, nproc)[0])}
    return subprocess.call(torchrun_argv(nproc, argv, command, module, module_args), env=env)
