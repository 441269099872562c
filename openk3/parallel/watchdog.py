"""The collective watchdog: a hang ends with an error naming the rank, the step and the collective it waited in.

Ranks that disagree on the next collective (one skips an all-to-all that the others wait in) block forever. torch
bounds the wait: `init_process_group(timeout=...)` makes gloo raise once a collective waits longer (NCCL's own
watchdog aborts), and `bound_subgroup_timeouts` gives the mesh's sub-groups the same bound (they default to 30
minutes, not the world's timeout). What torch's error lacks is where the rank was: gloo says "Timed out waiting
5000ms for recv operation". `CollectiveRecord` keeps, per rank, the collectives issued through `torch.distributed`
(name, sequence number, group), and `collective_watchdog` turns a distributed error at the step boundary into a
`CollectiveError` that names the rank, the caller's position (the step) and the collective in flight, with the
last few before it. Each rank raises its own, so together the ranks' messages show the mismatch.

The record wraps the `torch.distributed` functions callers reach as `dist.<name>` (FSDP2, DCP, our expert and
context parallelism); it costs one deque append per collective and is removed when the block ends.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


class CollectiveError(RuntimeError):
    """A collective did not complete (timed out, or a peer left): the message names rank, position and collective."""


class CollectiveRecord:
    """This rank's collectives issued through `torch.distributed`: the one in flight and the last `keep` issued."""

    def __init__(self, keep: int = 6):
        self.count = 0
        self.recent: collections.deque = collections.deque(maxlen=keep)  # (sequence number, name, group)
        self.in_flight: tuple | None = None
        self._originals: dict[str, Callable] = {}
        self._lock = threading.Lock()

    def install(self) -> CollectiveRecord:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            with self._lock:
                self.count += 1
                entry = (self.count, name, kwargs.get("group"))
                self.recent.append(entry)
            self.in_flight = entry  # cleared when the call returns (an async_op=True call returns at once), kept
            out = fn(*args, **kwargs)  # when it raises: that is the collective the error names
            self.in_flight = None
            return out

        recorded.__wrapped__ = fn
        return recorded

    def describe(self) -> str:
        def one(entry) -> str:
            seq, name, group = entry
            group = group if group is not None else dist.group.WORLD
            try:
                ranks = dist.get_process_group_ranks(group)
            except Exception:  # noqa: BLE001 - the group is gone (destroyed) or was never registered: the name still helps
                ranks = "?"
            return f"{name} #{seq} on group {getattr(group, 'group_desc', '?')} (ranks {ranks})"

        now = f"waiting in {one(self.in_flight)}" if self.in_flight else "no blocking collective in flight"
        last = ", ".join(one(e) for e in self.recent) or "none"
        return f"{now}; last issued: {last}"


def bound_subgroup_timeouts(timeout: timedelta) -> None:
    """Sub-groups made after this (the DeviceMesh's dp/ep/cp groups) time out after `timeout`, like the world group:
    `new_group` without a timeout takes torch's module default (30 minutes), not the world's."""
    distributed_c10d.default_pg_timeout = timeout


@contextlib.contextmanager
def collective_watchdog(where: Callable[[], str], timeout_s: float) -> Iterator[CollectiveRecord]:
    """Record this rank's collectives in the block; a distributed error raised in it (gloo's timeout, a peer that
    left, NCCL's abort) comes out as a CollectiveError naming the rank, `where()` (e.g. the step) and the collective.
    Other errors pass through unchanged."""
    record = CollectiveRecord().install()
    try:
        yield record
    except Exception as exc:
        if record.in_flight is None and not isinstance(exc, dist.DistError):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise CollectiveError(
            f"rank {rank} of {world}, {where()}: a collective did not complete (collective timeout {timeout_s:g} s, "
            f"OPENK3_COLLECTIVE_TIMEOUT_S): {record.describe()}. Ranks that wait in different collectives issued them "
            f"in different orders; compare every rank's message (TORCH_DISTRIBUTED_DEBUG=DETAIL checks the order). "
            f"torch said: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
        ) from exc
    finally:
        record.uninstall()
