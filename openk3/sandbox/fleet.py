"""The sandbox fleet of one machine: a warm pool of started sandboxes, reclaim of idle ones, garbage collection of
snapshot layers nothing references, capacity, and the numbers an operator watches (`stats()`, and `metrics()` in
Prometheus text, as the server's /metrics).

    fleet = Fleet(max_sandboxes=64, warm=4, memory_mb=512)
    sb = fleet.create()                      # from the warm pool; a FleetSandbox, a Sandbox like any other
    ref = sb.snapshot()                      # held by the fleet until fleet.release(ref)
    kids = fleet.fork(ref, 8)                # 8 sandboxes from one snapshot, each with its own writable layer
    fleet.release(ref); fleet.gc()           # layers no live sandbox or held ref uses are deleted

Capacity: `max_sandboxes` counts handed-out sandboxes; warm ones fill what is left (up to `warm`) and are closed to
make room when a create or fork needs it. Idle: a handed-out sandbox with no call for `idle_timeout_s` (paused ones
too) is closed by the background thread; its later calls raise SandboxClosed saying so.

What the fleet needs of a backend (the namespace backend offers it): `create() -> Sandbox` with the limits it was built
with, `layers() -> {layer id: bytes}` of its layer store, `delete_layers(ids)`, `close()`; forks go through a
sandbox's own `fork(ref, n)`. The fleet owns its backend's layer store: GC deletes any layer it does not know to be
in use. Thread-safe; one lock guards the bookkeeping, never a backend call.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from contextlib import contextmanager
from typing import Self

from openk3.sandbox.base import CapacityError, Sandbox, SandboxClosed, SandboxError, SnapshotRef, State
from openk3.sandbox.fleet_sandbox import FleetSandbox
from openk3.sandbox.metrics import FleetMetrics

log = logging.getLogger(__name__)
LIMITS = ("memory_mb", "cpus", "max_pids", "disk_mb")


class AsyncFleet:
    """The asyncio form of a fleet's calls, each in a worker thread (shared by Fleet and RayFleet)."""

    async def acreate(self) -> Sandbox:
        return await asyncio.to_thread(self.create)

    async def afork(self, ref: SnapshotRef, n: int = 1) -> list[Sandbox]:
        return await asyncio.to_thread(self.fork, ref, n)

    async def arelease(self, ref: SnapshotRef) -> None:
        return await asyncio.to_thread(self.release, ref)

    async def agc(self) -> list[str]:
        return await asyncio.to_thread(self.gc)

    async def astats(self) -> dict:
        return await asyncio.to_thread(self.stats)

    async def aclose(self) -> None:
        return await asyncio.to_thread(self.close)


class Fleet(AsyncFleet):
    def __init__(self, backend="namespace", max_sandboxes: int = 64, base_image: str | None = None, warm: int = 4,
                 idle_timeout_s: float = 300.0, *, node: str | None = None, **limits):  # fmt: skip
        """`backend`: a backend name ("namespace") or a backend object (then it was built with its image and limits).
        `node`: the name snapshot refs carry (the Ray fleet sets the Ray node id); default: the backend's own."""
        if max_sandboxes < 1:
            raise ValueError(f"max_sandboxes={max_sandboxes}: must be at least 1")
        if not 0 <= warm <= max_sandboxes:
            raise ValueError(f"warm={warm}: must be between 0 and max_sandboxes={max_sandboxes}")
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s}: must be positive")
        unknown = set(limits) - set(LIMITS)
        if unknown:
            raise ValueError(f"unknown sandbox limits {sorted(unknown)}: the limits are {', '.join(LIMITS)}")
        self.backend = open_backend(backend, base_image, limits)
        self.max_sandboxes, self.warm, self.idle_timeout_s, self.node = max_sandboxes, warm, idle_timeout_s, node
        self.metrics_ = FleetMetrics(self.stats)
        self._lock = threading.Condition()
        self._live: dict[str, FleetSandbox] = {}
        self._pool: collections.deque[Sandbox] = collections.deque()
        self._starting = 0  # sandboxes being created (inline or for the pool): they count against capacity
        self._refs: dict[str, SnapshotRef] = {}  # held snapshots, as the backend made them
        self._gate = _LayerGate()
        self._reclaimed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._maintain, name="sandbox-fleet", daemon=True)
        self._thread.start()

    def create(self) -> FleetSandbox:
        """A fresh sandbox, from the warm pool when it has one. CapacityError at `max_sandboxes`."""
        with self.metrics_.timed("create"):
            warm = self._reserve(1, take_warm=True)
            try:
                inner = warm[0] if warm else self.backend.create()
            except BaseException:
                self._unreserve(1)
                raise
            return self._adopt([inner], ())[0]

    def fork(self, ref: SnapshotRef, n: int = 1) -> list[FleetSandbox]:
        """`n` sandboxes starting from a held snapshot `ref`, each with its own writable layer."""
        with self.metrics_.timed("fork"):
            return self._fork(n, source=None, ref=ref)

    def release(self, ref: SnapshotRef) -> None:
        """Stop holding `ref`: its layers go at the next gc() unless a live sandbox or another ref uses them.
        Idempotent."""
        with self._lock:
            self._refs.pop(ref.id, None)

    def gc(self) -> list[str]:
        """Delete the layers of the backend's store that no live sandbox stands on and no held ref lists; returns
        their ids."""
        with self._gate.exclusive():
            in_use = self.layer_refcounts()
            dead = sorted(set(self.backend.layers()) - set(in_use))
            if dead:
                self.backend.delete_layers(dead)
        return dead

    def layer_refcounts(self) -> dict[str, int]:
        """Layer id -> how many live sandboxes stand on it plus how many held refs list it."""
        counts = collections.Counter()
        with self._lock:
            for sb in self._live.values():
                counts.update(sb.layers)
            for ref in self._refs.values():
                counts.update(ref.layers)
        return dict(counts)

    def sandboxes(self) -> list[FleetSandbox]:
        """The live (handed-out) sandboxes."""
        with self._lock:
            return list(self._live.values())

    def snapshots(self) -> list[SnapshotRef]:
        """The held snapshot refs, oldest first."""
        with self._lock:
            return [self._public(r) for r in self._refs.values()]

    def stats(self) -> dict:
        """Counts, the sandboxes' memory and disk (sum of their stats()), and the layer store."""
        with self._lock:
            live, pool = list(self._live.values()), list(self._pool)
            refs, reclaimed = len(self._refs), self._reclaimed
        memory = disk = pids = 0
        for sb in [s.inner for s in live] + pool:
            try:
                s = sb.stats()
            except SandboxError:  # closed under us (reclaimed, or its supervisor died): it holds nothing now
                continue
            memory, disk, pids = memory + s["memory_bytes"], disk + s["disk_bytes"], pids + s["pids"]
        layers = self.backend.layers()
        return {"live": len(live), "warm": len(pool), "paused": sum(s.state is State.PAUSED for s in live),
                "max_sandboxes": self.max_sandboxes, "memory_bytes": memory, "disk_bytes": disk, "pids": pids,
                "layers": len(layers), "layer_bytes": sum(layers.values()), "snapshots": refs,
                "reclaimed": reclaimed}  # fmt: skip

    def metrics(self) -> str:
        """Prometheus text exposition: per-operation latency histograms and the gauges of stats()."""
        return self.metrics_.render()

    def close(self) -> None:
        """Close every sandbox (live and warm) and the backend. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live, pool = list(self._live.values()), list(self._pool)
            self._pool.clear()
            self._lock.notify_all()
        self._thread.join(timeout=60)
        for sb in live:
            self._close(sb, reason="the fleet was closed")
        for inner in pool:
            inner.close()
        self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # What FleetSandbox calls.

    def _fork(self, n: int, source: FleetSandbox | None, ref: SnapshotRef | None = None,
              taken: SnapshotRef | None = None) -> list[FleetSandbox]:  # fmt: skip
        """Forks of the held `ref` (looked up under the gate: a release + gc meanwhile cannot take its layers), or of
        `taken`, a snapshot `source` just took and stands on."""
        if n < 1:
            raise ValueError(f"fork: n={n}: must be at least 1")
        self._reserve(n, take_warm=False)
        try:
            with self._gate.shared():
                held = taken or self._lookup(ref)
                inners = self._fork_inner(held, n, source)
        except BaseException:
            self._unreserve(n)
            raise
        return self._adopt(inners, held.layers)

    def _fork_inner(self, held: SnapshotRef, n: int, source: FleetSandbox | None) -> list[Sandbox]:
        if source is not None:
            return source.inner.fork(held, n)
        # Any sandbox of this backend can fork any ref of its store; a warm one is borrowed for it.
        with self._lock:
            lender = self._pool.popleft() if self._pool else None
        if lender is None:
            lender = self.backend.create()
        try:
            return lender.fork(held, n)
        finally:
            with self._lock:
                room = len(self._live) + self._starting + len(self._pool) < self.max_sandboxes
                keep = room and not self._closed and len(self._pool) < self.warm
                if keep:
                    self._pool.appendleft(lender)
            if not keep:
                lender.close()

    def _hold(self, ref: SnapshotRef) -> SnapshotRef:
        with self._lock:
            self._refs[ref.id] = ref
        return self._public(ref)

    def _lookup(self, ref: SnapshotRef) -> SnapshotRef:
        """The held ref behind `ref` (the backend's own form)."""
        with self._lock:
            held = self._refs.get(ref.id)
        if held is None:
            raise ValueError(f"snapshot {ref.id} is not held by this fleet (released, or taken outside it)")
        if self._public(held).node != ref.node:
            raise ValueError(f"snapshot {ref.id} names node {ref.node!r}; this fleet's is {self._public(held).node!r}")
        return held

    def _public(self, ref: SnapshotRef) -> SnapshotRef:
        return dataclasses.replace(ref, node=self.node) if self.node else ref

    def _enter(self, sb: FleetSandbox) -> None:
        with self._lock:
            if sb.closed:
                raise SandboxClosed(f"sandbox {sb.id}: {sb.closed}")
            sb.busy += 1

    def _leave(self, sb: FleetSandbox) -> None:
        with self._lock:
            sb.busy -= 1
            sb.last_used = time.monotonic()

    def _close(self, sb: FleetSandbox, reason: str) -> None:
        with self._lock:
            if sb.closed:
                return
            sb.closed = reason
            self._live.pop(sb.id, None)
            self._lock.notify_all()  # a slot is free: the pool may refill
        with self.metrics_.timed("close"):
            sb.inner.close()

    # Capacity and the pool.

    def _reserve(self, n: int, take_warm: bool) -> list[Sandbox]:
        """Count `n` sandboxes against capacity (or raise CapacityError); hand back a warm one for a create, and close
        warm ones that no longer fit."""
        with self._lock:
            if self._closed:
                raise SandboxClosed("the fleet is closed")
            if len(self._live) + self._starting + n > self.max_sandboxes:
                raise CapacityError(f"the fleet holds {len(self._live)} sandboxes (+{self._starting} starting) of "
                                    f"max_sandboxes={self.max_sandboxes}; {n} more do not fit")  # fmt: skip
            taken = []
            while take_warm and self._pool and not taken:
                inner = self._pool.popleft()
                if inner.state is State.CLOSED:  # died in the pool (its supervisor was killed)
                    continue
                taken.append(inner)
            self._starting += n
            evict = []
            while self._pool and len(self._live) + self._starting + len(self._pool) > self.max_sandboxes:
                evict.append(self._pool.pop())
            self._lock.notify_all()
        for inner in evict:
            inner.close()
        return taken

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._starting -= n
            self._lock.notify_all()

    def _adopt(self, inners: list[Sandbox], layers: tuple[str, ...]) -> list[FleetSandbox]:
        wrapped = [FleetSandbox(self, inner, layers) for inner in inners]
        with self._lock:
            self._starting -= len(inners)
            closed = self._closed
            if not closed:
                self._live.update((sb.id, sb) for sb in wrapped)
        if closed:  # the fleet closed while these started: they must not outlive it
            for sb in wrapped:
                sb.inner.close()
            raise SandboxClosed("the fleet was closed")
        return wrapped

    def _maintain(self) -> None:
        """The background thread: keep the pool at `warm` within capacity, one start at a time, and close idle
        sandboxes. A failing start backs off (the error reaches callers through create())."""
        tick = min(1.0, self.idle_timeout_s / 4)
        backoff = 0.0
        while True:
            with self._lock:
                if self._closed:
                    return
                room = self.max_sandboxes - len(self._live) - self._starting - len(self._pool)
                refill = min(self.warm - len(self._pool), room) > 0 and backoff == 0.0
                if refill:
                    self._starting += 1
                else:
                    self._lock.wait(timeout=backoff or tick)
                    backoff = 0.0
            if refill:
                try:
                    inner = self.backend.create()
                except Exception as err:  # noqa: BLE001 -- a background thread must not die; create() will raise it
                    log.warning("sandbox fleet: starting a warm sandbox failed: %s", err)
                    self._unreserve(1)
                    backoff = 5.0
                    continue
                with self._lock:
                    self._starting -= 1
                    room = len(self._live) + self._starting + len(self._pool) < self.max_sandboxes
                    keep = room and not self._closed and len(self._pool) < self.warm  # a lent one may be back
                    if keep:
                        self._pool.append(inner)
                if not keep:
                    inner.close()
            self._reclaim_idle()

    def _reclaim_idle(self) -> None:
        """Close idle sandboxes, and drop those that ended on their own (a killed supervisor): neither holds a slot."""
        now = time.monotonic()
        with self._lock:
            ended = [sb for sb in self._live.values() if sb.inner.state is State.CLOSED]
            idle = [sb for sb in self._live.values()
                    if not sb.busy and now - sb.last_used > self.idle_timeout_s and sb not in ended]  # fmt: skip
            self._reclaimed += len(idle)
        for sb in ended:
            self._close(sb, reason=f"it ended ({getattr(sb.inner, 'closed_reason', None) or 'its backend closed it'})")
        for sb in idle:
            self._close(sb, reason=f"reclaimed by the fleet after {self.idle_timeout_s:g} s idle")


def open_backend(backend, base_image: str | None, limits: dict):
    """A backend object from a name (built with the image and limits), or the object itself."""
    if not isinstance(backend, str):
        if base_image is not None or limits:
            raise ValueError("base_image and limits configure a backend named by string; this backend object was "
                             "built with its own")  # fmt: skip
        return backend
    if backend != "namespace":
        raise ValueError(f"backend={backend!r}: the backends are 'namespace'")
    from openk3.sandbox.namespace import NamespaceBackend

    return NamespaceBackend(base_image=base_image, **limits)


class _LayerGate:
    """Many layer-using calls (snapshot, restore, fork) at once, or one GC alone: a GC must not see a layer that a
    snapshot has written but not yet returned, which would look unreferenced. A waiting GC goes first."""

    def __init__(self):
        self._cond = threading.Condition()
        self._users = 0
        self._gc = False

    @contextmanager
    def shared(self):
        with self._cond:
            while self._gc:
                self._cond.wait()
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._gc:
                self._cond.wait()
            self._gc = True
            while self._users:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._gc = False
                self._cond.notify_all()
