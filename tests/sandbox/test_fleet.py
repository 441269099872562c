"""The fleet's own logic on an in-memory backend double (any host): warm pool, capacity, idle reclaim, layer refcounts
and GC with exact ids, stats and Prometheus text, close, async calls, and GC racing snapshots. The same fleet over the
real namespace backend is tested at the end (skipped where the host forbids namespaces)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from fleet_double import DoubleBackend

from openk3.sandbox.base import CapacityError, SandboxClosed, SandboxUnavailable, State
from openk3.sandbox.fleet import Fleet
from openk3.sandbox.fleet_sandbox import FleetSandbox


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_warm_pool_hands_out_and_refills():
    backend = DoubleBackend()
    with Fleet(backend, max_sandboxes=8, warm=3) as fleet:
        wait_for(lambda: fleet.stats()["warm"] == 3)
        assert backend.created == 3
        sb = fleet.create()
        assert isinstance(sb, FleetSandbox) and sb.state is State.RUNNING
        assert sb.exec(["true"]).exit_code == 0
        wait_for(lambda: fleet.stats()["warm"] == 3)
        assert backend.created == 4 and fleet.stats()["live"] == 1
    assert backend.alive() == [] and backend.closed


def test_capacity_counts_handed_out_and_evicts_warm():
    backend = DoubleBackend()
    with Fleet(backend, max_sandboxes=3, warm=2) as fleet:
        wait_for(lambda: fleet.stats()["warm"] == 2)
        a, b = fleet.create(), fleet.create()
        wait_for(lambda: fleet.stats()["warm"] == 1)  # refilled only up to capacity
        c = fleet.create()
        assert fleet.stats()["warm"] == 0
        with pytest.raises(CapacityError, match="max_sandboxes=3"):
            fleet.create()
        c.close()
        c.close()  # idempotent
        ref = a.snapshot()
        with pytest.raises(CapacityError):
            fleet.fork(ref, 2)
        b.close()
        wait_for(lambda: fleet.stats()["warm"] == 2)
        kids = fleet.fork(ref, 2)  # needs both free slots: the warm sandboxes make room
        assert len(kids) == 2 and fleet.stats()["warm"] == 0
        assert sorted(backend.alive()) == sorted([a.id] + [k.id for k in kids])


def test_pool_never_exceeds_warm_when_a_lent_sandbox_comes_back():
    """fleet.fork borrows a warm sandbox to fork from; a refill started while it is out must not grow the pool past
    `warm` once it is back. The double orders it: the fork waits until a refill has started, the refill until the
    fork is done."""
    backend = DoubleBackend()
    with Fleet(backend, max_sandboxes=8, warm=2, idle_timeout_s=2.0) as fleet:
        sb = fleet.create()
        ref = sb.snapshot()
        wait_for(lambda: fleet.stats()["warm"] == 2)
        backend.hold = threading.Event()
        kids = fleet.fork(ref, 2)  # the lender is back in the pool; a refill is waiting in create()
        assert fleet.stats()["warm"] == 2
        backend.hold.set()
        wait_for(lambda: len(backend.alive()) == 1 + len(kids) + 2 and fleet._starting == 0)
        time.sleep(0.1)
        assert fleet.stats()["warm"] == 2 and len(backend.alive()) == 5


def test_forks_are_isolated_and_start_from_the_ref():
    with Fleet(DoubleBackend(), max_sandboxes=10, warm=0) as fleet:
        sb = fleet.create()
        sb.write_file("/workspace/a", "one")
        ref = sb.snapshot()
        sb.write_file("/workspace/a", "two")
        kids = fleet.fork(ref, 3) + sb.fork(ref, 1)
        for i, kid in enumerate(kids):
            assert kid.read_file("/workspace/a") == b"one"
            kid.write_file("/workspace/a", f"kid{i}")
        assert [k.read_file("/workspace/a") for k in kids] == [f"kid{i}".encode() for i in range(4)]
        assert sb.read_file("/workspace/a") == b"two"
        (child,) = sb.fork()  # of a snapshot taken now
        assert child.read_file("/workspace/a") == b"two"
        with pytest.raises(ValueError, match="n=0"):
            fleet.fork(ref, 0)


def test_layer_refcounts_and_gc_delete_exactly_the_unused():
    backend = DoubleBackend()
    with Fleet(backend, max_sandboxes=10, warm=1) as fleet:
        sb = fleet.create()
        sb.write_file("/workspace/a", "a")
        ref1 = sb.snapshot()
        sb.write_file("/workspace/b", "b")
        ref2 = sb.snapshot()
        (l1,), (_, l2) = ref1.layers, ref2.layers
        kids = fleet.fork(ref1, 2)
        # sb stands on l1+l2; refs 1 and 2 list l1, ref 2 lists l2; both kids stand on l1.
        assert fleet.layer_refcounts() == {l1: 5, l2: 2}
        assert fleet.gc() == [] and set(backend.store) == {l1, l2}
        fleet.release(ref2)
        fleet.release(ref2)  # idempotent
        assert fleet.layer_refcounts() == {l1: 4, l2: 1}
        sb.restore(ref1)
        assert sb.read_file("/workspace/a") == b"a"
        with pytest.raises(FileNotFoundError):
            sb.read_file("/workspace/b")
        assert fleet.layer_refcounts() == {l1: 4}
        assert fleet.gc() == [l2] and set(backend.store) == {l1}
        with pytest.raises(ValueError, match="not held by this fleet"):
            sb.restore(ref2)
        for k in kids:
            k.close()
        fleet.release(ref1)
        assert fleet.gc() == [] and fleet.layer_refcounts() == {l1: 1}  # sb still stands on it
        sb.close()
        assert fleet.gc() == [l1] and backend.store == {}
        s = fleet.stats()
        assert (s["layers"], s["layer_bytes"], s["snapshots"]) == (0, 0, 0)


def test_idle_sandboxes_are_reclaimed_but_not_busy_ones():
    with Fleet(DoubleBackend(), max_sandboxes=4, warm=0, idle_timeout_s=0.2) as fleet:
        idle, busy = fleet.create(), fleet.create()
        t = threading.Thread(target=busy.exec, args=(["sleep"],), kwargs={"timeout": 0.8})
        t.start()
        wait_for(lambda: idle.state is State.CLOSED, timeout=3)
        with pytest.raises(SandboxClosed, match="reclaimed by the fleet after 0.2 s idle"):
            idle.exec(["true"])
        assert busy.state is State.RUNNING  # its call outlasted the idle timeout
        t.join()
        wait_for(lambda: busy.state is State.CLOSED, timeout=3)
        s = fleet.stats()
        assert (s["live"], s["reclaimed"]) == (0, 2)
        assert "openk3_sandbox_reclaimed_total 2.0" in fleet.metrics()


def test_stats_and_prometheus_metrics():
    with Fleet(DoubleBackend(), max_sandboxes=6, warm=1) as fleet:
        wait_for(lambda: fleet.stats()["warm"] == 1)
        a, b = fleet.create(), fleet.create()
        a.write_file("/workspace/x", b"12345")
        a.exec("true")
        b.pause()
        ref = a.snapshot()
        a.restore(ref)
        fleet.fork(ref, 1)
        b.resume()
        b.pause()
        wait_for(lambda: fleet.stats()["warm"] == 1)
        s = fleet.stats()
        assert {k: s[k] for k in ("live", "warm", "paused", "snapshots", "layers", "layer_bytes")} == {
            "live": 3, "warm": 1, "paused": 1, "snapshots": 1, "layers": 1, "layer_bytes": 5}  # fmt: skip
        assert s["memory_bytes"] == 4 << 20  # live and warm sandboxes, 1 MiB each in the double
        text = fleet.metrics()
        for op, n in (("create", 2), ("exec", 1), ("snapshot", 1), ("restore", 1), ("fork", 1), ("pause", 2),
                      ("resume", 1), ("close", 0)):  # fmt: skip
            assert f'openk3_sandbox_op_seconds_count{{op="{op}"}} {float(n)}' in text, op
        assert "openk3_sandbox_live 3.0" in text and "openk3_sandbox_paused 1.0" in text
        with pytest.raises(FileNotFoundError):
            a.read_file("/nope")
        assert 'openk3_sandbox_op_errors_total{error="FileNotFoundError",op="read_file"} 1.0' in fleet.metrics()


def test_close_is_idempotent_and_final():
    backend = DoubleBackend()
    fleet = Fleet(backend, max_sandboxes=4, warm=2)
    sb = fleet.create()
    fleet.close()
    fleet.close()
    assert backend.alive() == [] and sb.state is State.CLOSED
    with pytest.raises(SandboxClosed, match="fleet was closed"):
        sb.exec("true")
    with pytest.raises(SandboxClosed, match="fleet is closed"):
        fleet.create()


def test_async_calls():
    async def episode(fleet):
        sb = await fleet.acreate()
        await sb.awrite_file("/workspace/f", "x")
        ref = await sb.asnapshot()
        kids = await fleet.afork(ref, 2)
        results = await asyncio.gather(*(k.aexec(["echo", str(i)]) for i, k in enumerate(kids)))
        assert [r.stdout for r in results] == ["echo 0", "echo 1"]
        assert await kids[0].aread_file("/workspace/f") == b"x"
        await sb.aclose()
        return await fleet.astats()

    with Fleet(DoubleBackend(), max_sandboxes=4, warm=0) as fleet:
        assert asyncio.run(episode(fleet))["live"] == 2


def test_bad_arguments_are_value_errors():
    backend = DoubleBackend()
    for kwargs, match in (({"max_sandboxes": 0}, "max_sandboxes=0"), ({"warm": 9}, "warm=9"),
                          ({"idle_timeout_s": 0}, "idle_timeout_s=0"), ({"memory_gb": 1}, "memory_gb")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Fleet(backend, max_sandboxes=kwargs.pop("max_sandboxes", 8), **kwargs)
    with pytest.raises(ValueError, match="built with its own"):
        Fleet(backend, memory_mb=64)
    with pytest.raises(ValueError, match="'namespace'"):
        Fleet("firecracker")


def test_gc_racing_snapshots_restores_and_forks_never_takes_a_used_layer():
    """Threads snapshot, restore, fork and release while another collects: the double fails on any delete of a
    mounted layer and any restore or fork of a deleted one."""
    backend = DoubleBackend()
    errors = []
    with Fleet(backend, max_sandboxes=64, warm=2) as fleet:
        stop = threading.Event()

        def worker(i):
            try:
                sb = fleet.create()
                for j in range(30):
                    sb.write_file(f"/workspace/{i}", str(j))
                    ref = sb.snapshot()
                    (kid,) = fleet.fork(ref, 1)
                    assert kid.read_file(f"/workspace/{i}") == str(j).encode()
                    kid.close()
                    sb.restore(ref)
                    fleet.release(ref)
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        def collector():
            while not stop.is_set():
                fleet.gc()

        gc_thread = threading.Thread(target=collector)
        gc_thread.start()
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        gc_thread.join()
        assert errors == []
        fleet.gc()
        # Each worker's sandbox stands on its last snapshot's chain; nothing else is left.
        assert set(backend.store) == set(fleet.layer_refcounts())


def _zygote_tree(backend_id: str) -> list[int]:
    """The pids of this backend's zygote (found by its id on its command line) and every process below it."""
    children, zygote = {}, None
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except OSError:
            continue
    for pid in children.get(os.getpid(), []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"zygote.py" in cmdline and backend_id.encode() in cmdline:
            zygote = pid
    tree, todo = [], [zygote] if zygote else []
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def test_fleet_on_namespace_sandboxes():
    """The same fleet over the real backend: pool, isolation of forks, layer GC against the real store (which refuses
    to delete a mounted layer), stats from the cgroups, reclaim, and no process left after close."""
    try:
        fleet = Fleet(max_sandboxes=6, warm=2, idle_timeout_s=2.0, memory_mb=256)
    except SandboxUnavailable as err:
        pytest.skip(f"namespace backend unavailable here: {err}")
    with fleet:
        wait_for(lambda: fleet.stats()["warm"] == 2, timeout=30)
        sb = fleet.create()
        sb.write_file("/workspace/a.txt", "one")
        ref = sb.snapshot()
        sb.write_file("/workspace/a.txt", "two")
        kids = fleet.fork(ref, 2)
        kids[0].write_file("/workspace/a.txt", "kid")
        assert [k.read_file("/workspace/a.txt") for k in kids] == [b"kid", b"one"]
        assert sb.exec(["cat", "/workspace/a.txt"]).stdout == "two"
        s = fleet.stats()
        assert s["live"] == 3 and s["layers"] == 1 and s["snapshots"] == 1 and s["memory_bytes"] > 0
        assert s["pids"] == 0  # idle: nothing runs in them
        fleet.release(ref)
        assert fleet.gc() == []  # the kids and sb stand on it
        for k in kids:
            k.close()
        sb.close()
        assert fleet.gc() == list(ref.layers) and fleet.backend.layers() == {}
        idle = fleet.create()
        wait_for(lambda: idle.state is State.CLOSED, timeout=10)
        assert fleet.stats()["reclaimed"] == 1
        assert 'openk3_sandbox_op_seconds_count{op="fork"} 1.0' in fleet.metrics()
        tree = _zygote_tree(fleet.backend.id)
        assert len(tree) >= 1 + 2 * 2  # the zygote, and two processes per warm sandbox
    assert fleet.backend.closed and not os.path.exists(fleet.backend.dir)
    assert not [pid for pid in tree if os.path.exists(f"/proc/{pid}")]
