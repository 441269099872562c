"""A sandbox handed out by a `Fleet`: the backend's sandbox behind the same `Sandbox` protocol, with every call timed
into the fleet's histograms, its idleness tracked for reclaim, and the snapshot layers it stands on recorded for the
fleet's layer GC.

Layer tracking: a sandbox stands on the layers of the last snapshot it took, restored or was forked from (none for a
fresh one); the fleet's GC keeps every layer some live sandbox stands on or some held snapshot ref lists.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from openk3.sandbox.base import DEFAULT_TIMEOUT_S, DirEntry, ExecResult, Sandbox, SnapshotRef, State

if TYPE_CHECKING:
    from openk3.sandbox.fleet import Fleet


class FleetSandbox(Sandbox):
    def __init__(self, fleet: Fleet, inner: Sandbox, layers: tuple[str, ...]):
        self.id = inner.id
        self.inner = inner
        self.layers = tuple(layers)  # what it stands on (see the module docstring)
        self.last_used = time.monotonic()
        self.busy = 0  # calls in flight: a busy sandbox is never idle (the fleet's lock guards this and `closed`)
        self.closed: str | None = None  # why, once the fleet no longer holds it
        self._fleet = fleet

    @property
    def state(self) -> State:
        return State.CLOSED if self.closed else self.inner.state

    def __repr__(self) -> str:
        return f"FleetSandbox({self.id!r}, {self.state.value}, layers={len(self.layers)})"

    @contextmanager
    def _call(self, op: str):
        self._fleet._enter(self)
        try:
            with self._fleet.metrics_.timed(op):
                yield
        finally:
            self._fleet._leave(self)

    def exec(self, cmd: str | list[str], timeout: float = DEFAULT_TIMEOUT_S, stdin: str | bytes | None = None,
             env: dict[str, str] | None = None, cwd: str = "/workspace") -> ExecResult:  # fmt: skip
        with self._call("exec"):
            return self.inner.exec(cmd, timeout=timeout, stdin=stdin, env=env, cwd=cwd)

    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        with self._call("write_file"):
            self.inner.write_file(path, data, mode=mode)

    def read_file(self, path: str) -> bytes:
        with self._call("read_file"):
            return self.inner.read_file(path)

    def list_dir(self, path: str = "/workspace") -> list[DirEntry]:
        with self._call("list_dir"):
            return self.inner.list_dir(path)

    def snapshot(self, *, stop_processes: bool = False, memory: bool = False) -> SnapshotRef:
        """The new ref is held by the fleet (its layers survive GC) until `fleet.release(ref)`."""
        return self._fleet._hold(self._snapshot(stop_processes, memory))

    def _snapshot(self, stop_processes: bool, memory: bool) -> SnapshotRef:
        with self._call("snapshot"), self._fleet._gate.shared():
            ref = self.inner.snapshot(stop_processes=stop_processes, memory=memory)
            self.layers = ref.layers
        return ref

    def restore(self, ref: SnapshotRef) -> None:
        with self._call("restore"), self._fleet._gate.shared():
            held = self._fleet._lookup(ref)  # under the gate: a release + gc meanwhile cannot take its layers
            self.inner.restore(held)
            self.layers = held.layers

    def fork(self, ref: SnapshotRef | None = None, n: int = 1) -> list[Sandbox]:
        """Forks of a held ref, or of a snapshot taken now (not held: the forks and this sandbox keep its layers)."""
        taken = self._snapshot(False, False) if ref is None else None
        with self._call("fork"):
            return self._fleet._fork(n, source=self, ref=ref, taken=taken)

    def pause(self) -> None:
        with self._call("pause"):
            self.inner.pause()

    def resume(self) -> None:
        with self._call("resume"):
            self.inner.resume()

    def stats(self) -> dict:
        with self._call("stats"):
            return self.inner.stats()

    def close(self) -> None:
        """Close it and give its slot back to the fleet. Idempotent."""
        self._fleet._close(self, reason="closed by the caller")
