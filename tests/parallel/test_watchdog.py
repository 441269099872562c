"""The collective watchdog (parallel/watchdog.py): a rank that skips a collective makes every rank fail within the
collective timeout, each with a CollectiveError naming its rank, its step and the collective it waited in; errors
that are not distributed pass through unchanged; the record leaves torch.distributed as it found it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from openk3.parallel.watchdog import CollectiveError, bound_subgroup_timeouts, collective_watchdog
from tests.parallel.dist_helpers import run_ranks

TIMEOUT_S = 3.0


def _one_rank_skips(rank: int, world: int) -> dict:
    bound_subgroup_timeouts(timedelta(seconds=TIMEOUT_S))
    side = dist.new_group(list(range(world)), group_desc="side")  # a sub-group, as the mesh's dp/ep groups are
    original = dist.all_reduce
    step = 0
    try:
        with collective_watchdog(lambda: f"in step {step}", TIMEOUT_S):
            for step in range(1, 5):
                t = torch.ones(2)
                if not (rank == 1 and step == 2):  # rank 1 skips the world all-reduce of step 2 ...
                    dist.all_reduce(t)
                dist.all_reduce(t, group=side)  # ... and waits here while rank 0 waits in the skipped one
    except CollectiveError as e:
        message = str(e)
    else:
        message = "no error"
    with pytest.raises(ValueError, match="not distributed"), collective_watchdog(lambda: "in step 0", TIMEOUT_S):
        raise ValueError("not distributed")  # other errors are not rewritten
    return {"message": message, "restored": dist.all_reduce is original, "step": step}


def test_a_skipped_collective_fails_quickly_naming_rank_step_and_collective():
    start = time.perf_counter()
    out = run_ranks(2, _one_rank_skips, timeout=timedelta(seconds=TIMEOUT_S))
    assert time.perf_counter() - start < 60  # the hang became an error within a few timeouts, not a stuck test
    for rank, r in enumerate(out):
        assert r["restored"] and r["step"] == 2
        assert r["message"].startswith(f"rank {rank} of 2, in step 2: a collective did not complete"), r["message"]
    # rank 0 waits in the world all-reduce #3 (the one rank 1 skipped); rank 1 waits in the side group's #3
    assert "waiting in all_reduce #3 on group default_pg (ranks [0, 1])" in out[0]["message"]
    assert "waiting in all_reduce #3 on group side (ranks [0, 1])" in out[1]["message"]
    last = "last issued: all_reduce #1 on group default_pg (ranks [0, 1]), all_reduce #2 on group side"
    assert last in out[0]["message"]
