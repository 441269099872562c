"""The sandbox fleet over a Ray cluster: the `Fleet` API with one `Fleet` actor per node.

    fleet = RayFleet(address="auto", max_sandboxes_per_node=256, warm=8)
    sb = fleet.create()               # on the node with the most free slots; a RaySandbox handle
    ref = sb.snapshot()               # ref.node is the Ray node id: its layers stay on that node
    kids = fleet.fork(ref, 16)        # run on ref.node, where the layers are
    fleet.stats()["nodes"]            # per node; the top-level numbers are sums over nodes

Each node's actor (`NodeFleet`, pinned with NodeAffinitySchedulingStrategy, 0 CPUs: the sandboxes, not the actor,
use the node's cores) runs a plain `Fleet`, so warm pool, capacity, idle reclaim and layer GC are per node. A
`RaySandbox` is a small picklable handle (its node, its id and the actors): any Ray task may call it, and every call
runs in the owning actor. Layers never move between nodes: a restore of a ref from another node raises
`Unsupported`; a fork lands on the ref's node. Ray is the optional extra `openk3[rl]`; the package must be
installed on every node, and the actors live as long as the driver that made them (or `close()`).
"""

from __future__ import annotations

import collections
from typing import Self

from openk3.sandbox.base import (
    CALL_DEADLINE_S,
    DEFAULT_TIMEOUT_S,
    CapacityError,
    DirEntry,
    ExecResult,
    Sandbox,
    SandboxClosed,  # fmt: skip
    SandboxTimeout,
    SnapshotRef,
    State,
    Unsupported,
)
from openk3.sandbox.fleet import AsyncFleet, Fleet


def _ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError("RayFleet needs Ray: pip install 'openk3[rl]' (ray>=2.9)") from err
    return ray


def _get(obj_ref, timeout: float):
    """ray.get with a deadline, raising the remote call's own exception (a CapacityError stays a CapacityError)."""
    ray = _ray()
    try:
        return ray.get(obj_ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise SandboxTimeout(f"no answer from the node's fleet actor in {timeout:g} s") from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, Exception):
            raise err.cause from None
        raise


class NodeFleet:
    """The actor body: one `Fleet` on one node, its sandboxes addressed by id."""

    def __init__(self, node: str, backend, options: dict):
        # A factory runs here, on the node: backend objects hold processes and cannot travel.
        self.fleet = Fleet(backend() if callable(backend) else backend, node=node, **options)
        self.node = node
        self.handles: dict[str, Sandbox] = {}

    def free(self) -> int:
        return self.fleet.max_sandboxes - len(self.fleet.sandboxes())

    def create(self) -> str:
        return self._adopt([self.fleet.create()])[0]

    def fork(self, ref: SnapshotRef, n: int) -> list[str]:
        return self._adopt(self.fleet.fork(ref, n))

    def call(self, sid: str, method: str, args: tuple, kwargs: dict):
        sb = self.handles.get(sid)
        if sb is None or sb.state is State.CLOSED:
            self.handles.pop(sid, None)
            raise SandboxClosed(f"sandbox {sid} on node {self.node}: {getattr(sb, 'closed', None) or 'closed'}")
        if method == "state":
            return sb.state
        result = getattr(sb, method)(*args, **kwargs)
        return self._adopt(result) if method == "fork" else result

    def release(self, ref: SnapshotRef) -> None:
        self.fleet.release(ref)

    def gc(self) -> list[str]:
        return self.fleet.gc()

    def stats(self) -> dict:
        return self.fleet.stats()

    def metrics(self) -> str:
        return self.fleet.metrics()

    def listing(self) -> tuple[list[str], list[SnapshotRef]]:
        return [sb.id for sb in self.fleet.sandboxes()], self.fleet.snapshots()

    def close(self) -> None:
        self.fleet.close()

    def _adopt(self, sandboxes: list[Sandbox]) -> list[str]:
        self.handles.update((sb.id, sb) for sb in sandboxes)
        return [sb.id for sb in sandboxes]


class RayFleet(AsyncFleet):
    def __init__(self, address: str | None = None, max_sandboxes_per_node: int = 64, backend="namespace",
                 base_image: str | None = None, warm: int = 4, idle_timeout_s: float = 300.0, **limits):  # fmt: skip
        """`address`: the Ray cluster (None: the one this process is connected to, else RAY_ADDRESS or a new local
        one, as ray.init). `backend`: a name, or a zero-argument callable that builds a backend on each node."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        options = {"max_sandboxes": max_sandboxes_per_node, "base_image": base_image, "warm": warm,
                   "idle_timeout_s": idle_timeout_s, **limits}  # fmt: skip
        actor_class = ray.remote(NodeFleet)
        self.actors = {
            node: actor_class.options(
                num_cpus=0, max_concurrency=max_sandboxes_per_node + 8,  # one call per sandbox, and the fleet's own
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(node, backend, options)
            for node in nodes
        }  # fmt: skip
        self._closed = False
        try:  # an actor that cannot start its fleet (no namespaces on that node, ...) fails here, not at create()
            _get([a.free.remote() for a in self.actors.values()], timeout=120)
        except BaseException:
            self.close()
            raise

    def create(self) -> RaySandbox:
        """A sandbox on the node with the most free slots (the next one if that one filled up meanwhile)."""
        nodes = list(self.actors)
        free = _get([self.actors[n].free.remote() for n in nodes], timeout=CALL_DEADLINE_S)
        for _, node in sorted(zip(free, nodes), key=lambda x: -x[0]):
            try:
                sid = _get(self.actors[node].create.remote(), timeout=CALL_DEADLINE_S)
            except CapacityError:
                continue
            return RaySandbox(self.actors, node, sid)
        raise CapacityError(f"every node's fleet is full ({len(nodes)} nodes)")

    def fork(self, ref: SnapshotRef, n: int = 1) -> list[RaySandbox]:
        """`n` sandboxes from `ref`, on the node that holds its layers."""
        sids = _get(self._actor(ref.node).fork.remote(ref, n), timeout=CALL_DEADLINE_S)
        return [RaySandbox(self.actors, ref.node, sid) for sid in sids]

    def release(self, ref: SnapshotRef) -> None:
        _get(self._actor(ref.node).release.remote(ref), timeout=CALL_DEADLINE_S)

    def gc(self) -> list[str]:
        """Layer GC on every node; the deleted layer ids, all nodes together."""
        return [lid for ids in self._all("gc") for lid in ids]

    def sandboxes(self) -> list[RaySandbox]:
        return [RaySandbox(self.actors, node, sid) for node, (sids, _) in zip(self.actors, self._all("listing"))
                for sid in sids]  # fmt: skip

    def snapshots(self) -> list[SnapshotRef]:
        return [ref for _, refs in self._all("listing") for ref in refs]

    def stats(self) -> dict:
        """Each node's `Fleet.stats()` under "nodes", and their sums at the top."""
        per_node = dict(zip(self.actors, self._all("stats")))
        totals = collections.Counter()
        for s in per_node.values():
            totals.update(s)
        return {**totals, "nodes": per_node}

    def metrics(self) -> str:
        """Every node's metrics in one exposition, each sample labelled with its node."""
        return merge_metrics(dict(zip(self.actors, self._all("metrics"))))

    def close(self) -> None:
        """Close every node's fleet (its sandboxes and backend) and end the actors. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        for actor in self.actors.values():
            try:
                _get(actor.close.remote(), timeout=CALL_DEADLINE_S)
            finally:
                ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _actor(self, node: str):
        if node not in self.actors:
            raise ValueError(f"node {node!r} is not one of this fleet's nodes {sorted(self.actors)}")
        return self.actors[node]

    def _all(self, method: str) -> list:
        return _get([getattr(a, method).remote() for a in self.actors.values()], timeout=CALL_DEADLINE_S)


class RaySandbox(Sandbox):
    """A handle on a sandbox living in one node's fleet actor; picklable, so Ray tasks can pass it around."""

    def __init__(self, actors: dict, node: str, sid: str):
        self.actors, self.node, self.id = actors, node, sid

    def __repr__(self) -> str:
        return f"RaySandbox({self.id!r}, node={self.node[:12]!r})"

    def _call(self, method: str, *args, deadline: float = CALL_DEADLINE_S, **kwargs):
        return _get(self.actors[self.node].call.remote(self.id, method, args, kwargs), timeout=deadline)

    @property
    def state(self) -> State:
        try:
            return self._call("state")
        except SandboxClosed:
            return State.CLOSED

    def exec(self, cmd: str | list[str], timeout: float = DEFAULT_TIMEOUT_S, stdin: str | bytes | None = None,
             env: dict[str, str] | None = None, cwd: str = "/workspace") -> ExecResult:  # fmt: skip
        return self._call("exec", cmd, timeout=timeout, stdin=stdin, env=env, cwd=cwd,
                          deadline=timeout + CALL_DEADLINE_S)  # fmt: skip

    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        self._call("write_file", path, data, mode=mode)

    def read_file(self, path: str) -> bytes:
        return self._call("read_file", path)

    def list_dir(self, path: str = "/workspace") -> list[DirEntry]:
        return self._call("list_dir", path)

    def snapshot(self, *, stop_processes: bool = False, memory: bool = False) -> SnapshotRef:
        return self._call("snapshot", stop_processes=stop_processes, memory=memory)

    def restore(self, ref: SnapshotRef) -> None:
        if ref.node != self.node:
            raise Unsupported(f"restore: snapshot {ref.id} lives on node {ref.node}, sandbox {self.id} on node "
                              f"{self.node}; layers do not move between nodes (fork the snapshot on its node: "
                              "fleet.fork(ref, n))")  # fmt: skip
        self._call("restore", ref)

    def fork(self, ref: SnapshotRef | None = None, n: int = 1) -> list[Sandbox]:
        """Forks land where the snapshot lives: this node for a snapshot of this sandbox, `ref.node` otherwise."""
        if ref is not None and ref.node != self.node:
            if ref.node not in self.actors:
                raise ValueError(f"fork: snapshot {ref.id} names node {ref.node!r}, not one of this fleet's")
            sids = _get(self.actors[ref.node].fork.remote(ref, n), timeout=CALL_DEADLINE_S)
            return [RaySandbox(self.actors, ref.node, sid) for sid in sids]
        return [RaySandbox(self.actors, self.node, sid) for sid in self._call("fork", ref, n)]

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        try:
            self._call("close")
        except SandboxClosed:  # idempotent, as every Sandbox's close
            pass


def merge_metrics(texts: dict[str, str]) -> str:
    """One Prometheus exposition from several, each sample labelled node=<its key> (a metric family may appear only
    once in an exposition, so the families are merged, not concatenated)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for node, text in texts.items():
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            merged.samples += [Sample(s.name, {**s.labels, "node": node}, s.value, s.timestamp, s.exemplar)
                               for s in fam.samples]  # fmt: skip

    class _Merged:
        def collect(self):
            return families.values()

    registry = CollectorRegistry()
    registry.register(_Merged())
    return generate_latest(registry).decode()
