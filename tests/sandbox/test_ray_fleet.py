"""RayFleet on a local two-node Ray cluster on the loopback (ray.cluster_utils.Cluster: each node's GCS/raylet are
subprocesses of this test, stopped by Cluster.shutdown, never by name): placement by free slots reaches both nodes,
calls run on the owning node, a fork lands where its snapshot lives, a cross-node restore is a clear error, stats and
metrics are per node and summed. First on the in-memory backend double (any host), then on the namespace backend."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time

import pytest

# Ray resolves 127.0.0.1 to the machine's outward address unless told it runs a local-only cluster; read at import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Tests send traffic to 127.0.0.1 only: no usage-statistics reports to Ray's servers.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="Ray is the optional extra openk3[rl]: pip install 'openk3[rl]'")

import fleet_double
from fleet_double import DoubleBackend

from openk3.sandbox.base import CapacityError, SandboxError, State, Unsupported
from openk3.sandbox.ray_fleet import RayFleet


@pytest.fixture(scope="module")
def cluster():
    """{"node_a": node id, "node_b": node id} of a two-node cluster, one CPU each."""
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="k3ray")  # short: Ray's Unix sockets live under it
    # Ray (2.60) also writes the cluster's address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster whatever temp_dir
    # says, and fails where that folder does not exist: point it into our temp_dir too.
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                      "include_dashboard": False, "node_ip_address": "127.0.0.1",
                                                      "temp_dir": temp_dir})  # fmt: skip
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.1")
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=30)
        # The double travels to the actors by value: the workers cannot import tests/sandbox.
        ray.cloudpickle.register_pickle_by_value(fleet_double)
        nodes = {name: n["NodeID"] for n in ray.nodes() for name in ("node_a", "node_b") if name in n["Resources"]}
        assert len(nodes) == 2
        print(f"two-node cluster up in {time.monotonic() - t0:.1f} s")
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_fleet_on_the_double(cluster):
    a, b = cluster["node_a"], cluster["node_b"]
    with RayFleet(max_sandboxes_per_node=4, backend=DoubleBackend, warm=0) as fleet:
        assert sorted(fleet.actors) == sorted([a, b])
        sbs = [fleet.create() for _ in range(4)]
        assert sorted(sb.node for sb in sbs) == sorted([a, a, b, b])  # most free slots first: they alternate
        for sb in sbs:
            assert sb.exec(["echo", sb.node]).stdout == f"echo {sb.node}"
        on_a, on_b = [sb for sb in sbs if sb.node == a], [sb for sb in sbs if sb.node == b]
        on_a[0].write_file("/workspace/f", "from a")
        ref = on_a[0].snapshot()
        assert ref.node == a
        kids = fleet.fork(ref, 2)
        assert [k.node for k in kids] == [a, a] and kids[0].read_file("/workspace/f") == b"from a"
        with pytest.raises(CapacityError):  # node A is full; a fork cannot spill to B, the layers are on A
            fleet.fork(ref, 1)
        with pytest.raises(Unsupported, match="layers do not move between nodes"):
            on_b[0].restore(ref)
        kids[1].close()
        (grandkid,) = on_b[0].fork(ref, 1)  # a fork of A's snapshot from a B sandbox still lands on A
        assert grandkid.node == a
        # The handle is picklable (Ray tasks pass it around) and still reaches its sandbox.
        clone = pickle.loads(pickle.dumps(on_b[1]))
        assert clone.exec("true").exit_code == 0 and clone.state is State.RUNNING
        s = fleet.stats()
        assert (s["live"], s["nodes"][a]["live"], s["nodes"][b]["live"]) == (6, 4, 2)
        assert s["snapshots"] == 1 and s["layers"] == 1
        text = fleet.metrics()
        assert f'openk3_sandbox_live{{node="{a}"}} 4.0' in text and f'openk3_sandbox_live{{node="{b}"}} 2.0' in text
        assert f'openk3_sandbox_op_seconds_count{{node="{a}",op="fork"}} 3.0' in text  # 2 forks and a refused one
        on_b[1].close()
        assert on_b[1].state is State.CLOSED
        with pytest.raises(SandboxError, match="closed"):
            on_b[1].exec("true")
        fleet.release(ref)
        assert fleet.gc() == []  # the kids still stand on the layer
        assert len(fleet.sandboxes()) == 5 and fleet.snapshots() == []
        more = [fleet.create() for _ in range(3)]  # A is full: all on B
        assert {sb.node for sb in more} == {b}
        with pytest.raises(CapacityError, match="every node's fleet is full"):
            fleet.create()


def test_ray_fleet_on_namespace_sandboxes(cluster):
    a = cluster["node_a"]
    t0 = time.monotonic()
    try:
        fleet = RayFleet(max_sandboxes_per_node=4, warm=1, memory_mb=256)
    except SandboxError as err:  # SandboxUnavailable from a node's actor: this host forbids namespaces
        pytest.skip(f"namespace backend unavailable here: {err}")
    with fleet:
        sbs = [fleet.create(), fleet.create()]
        assert {sb.node for sb in sbs} == set(cluster.values())
        for sb in sbs:
            r = sb.exec(["sh", "-c", "echo $$"])
            assert r.exit_code == 0 and int(r.stdout) < 10, r  # its own PID namespace (the supervisor is PID 1)
        (sa,) = [sb for sb in sbs if sb.node == a]
        sa.write_file("/workspace/state.txt", "on a")
        ref = sa.snapshot()
        (kid,) = fleet.fork(ref, 1)
        assert kid.node == a and kid.read_file("/workspace/state.txt") == b"on a"
        s = fleet.stats()
        assert s["live"] == 3 and s["memory_bytes"] > 0 and s["nodes"][a]["live"] == 2
    print(f"namespace sandboxes on two Ray nodes: {time.monotonic() - t0:.1f} s")
