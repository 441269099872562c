"""Multi-process test harness: spawn N gloo ranks on CPU (one thread each) and collect what each returns."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def _entry(rank: int, world: int, store: str, fn, args, results, timeout: timedelta) -> None:
    torch.set_num_threads(1)
    # A file rendezvous: no TCP port to race for when several tests spawn ranks on a busy machine.
    # A collective that never matches (a hang) fails the test after `timeout` instead of waiting forever.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    try:
        results[rank] = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - any failure of a rank goes back to the parent, with its traceback
        results[rank] = RuntimeError(traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: timedelta = COLLECTIVE_TIMEOUT) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; returns every rank's result (re-raising a rank's error).
    `timeout` bounds each collective (a shorter one for tests that make a collective hang on purpose)."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), fn, args, results, timeout), nprocs=world, join=True)
        out = [results[r] for r in range(world)]
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out
