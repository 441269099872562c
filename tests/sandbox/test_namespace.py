"""The namespace backend's behaviour, on real namespaces (skipped with the host's reason where they are forbidden):
exec and files, snapshot/restore giving back exactly the snapshot's tree, forks that never see each other's writes,
a chain of 50 snapshots, the state machine, and a killed backend that leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from openk3.sandbox import (
    NamespaceBackend,
    SandboxBusy,
    SandboxClosed,
    SandboxTimeout,
    State,
    Unsupported,
    namespace_sandbox,
)
from openk3.sandbox.image import build_skeleton

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_exec_argv_shell_stdin_env_cwd_and_exit_codes(sandbox):
    r = sandbox.exec(["echo", "héllo wörld ✓"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.limit, r.truncated) == (
        0,
        "héllo wörld ✓\n",
        "",
        False,
        None,
        False,
    )
    assert 0 < r.duration < 5
    r = sandbox.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert sandbox.exec(["cat"], stdin="from stdin").stdout == "from stdin"
    hexed = sandbox.exec(
        ["python3", "-c", "import sys; print(sys.stdin.buffer.read().hex())"], stdin=b"\x00\xff" * 40000
    )
    assert hexed.stdout.strip() == "00ff" * 40000  # larger than a pipe's buffer, both ways
    assert sandbox.exec("echo $FOO:$HOME:$USER:$LANG", env={"FOO": "bar"}).stdout == "bar:/workspace:sandbox:C.UTF-8\n"
    assert sandbox.exec("pwd").stdout == "/workspace\n"
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.exec("id -u; id -g; id -G").stdout.split() == ["1000", "1000", "1000"]
    assert sandbox.exec("kill -9 $$").exit_code == 128 + 9
    missing = sandbox.exec(["no-such-command", "x"])
    assert missing.exit_code == 127 and "no-such-command" in missing.stderr
    assert sandbox.exec(["python3", "-c", "import sys; sys.stdout.buffer.write(b'a\\xffb')"]).stdout == "a\ufffdb"
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        sandbox.exec("true", cwd="/nowhere")
    with pytest.raises(ValueError):
        sandbox.exec([])


def test_output_cap_truncates_and_keeps_draining(sandbox):
    r = sandbox.exec("head -c 3000000 /dev/zero | tr '\\0' a; head -c 2000000 /dev/zero >&2; echo done >&2", timeout=20)
    assert r.exit_code == 0 and r.truncated and r.limit == "output"
    assert len(r.stdout) == 1 << 20 and set(r.stdout) == {"a"}
    assert len(r.stderr) == 1 << 20  # the writer was never blocked: it finished (the tail is past the cap)


def test_timeout_kills_the_process_group(sandbox):
    r = sandbox.exec("sleep 100 & sleep 100", timeout=0.5)
    assert r.timed_out and r.exit_code == 137 and r.limit == "timeout" and r.duration < 3
    assert sandbox.stats()["pids"] == 0  # the background sleep was in the group too
    assert sandbox.exec("echo alive").stdout == "alive\n"


def test_files_round_trip(sandbox):
    sandbox.write_file("/workspace/a/b/c.txt", "hello")
    sandbox.write_file("/workspace/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    sandbox.write_file("secret", b"\x00\x01" * 100000, mode=0o600)  # relative: in /workspace
    assert sandbox.read_file("/workspace/a/b/c.txt") == b"hello"
    assert sandbox.read_file("/workspace/secret") == b"\x00\x01" * 100000
    assert sandbox.exec("./run.sh").stdout == "ran\n"
    sandbox.write_file("/workspace/a/b/c.txt", "replaced")
    assert sandbox.exec("cat a/b/c.txt; stat -c %a run.sh secret a").stdout == "replaced755\n600\n755\n"
    sandbox.exec("ln -s a/b/c.txt link; mkfifo fifo; echo x > made-by-exec")
    assert sandbox.read_file("made-by-exec") == b"x\n" and sandbox.read_file("link") == b"replaced"
    entries = {e.name: (e.kind, e.size, e.mode) for e in sandbox.list_dir()}
    assert entries == {"a": ("dir", entries["a"][1], 0o755), "fifo": ("other", 0, 0o644), "link": ("symlink", 9, 0o777),
                       "made-by-exec": ("file", 2, 0o644), "run.sh": ("file", 19, 0o755),
                       "secret": ("file", 200000, 0o600)}  # fmt: skip
    assert [e.name for e in sandbox.list_dir("/workspace")] == sorted(entries)
    with pytest.raises(FileNotFoundError, match="/workspace/nope"):
        sandbox.read_file("/workspace/nope")
    with pytest.raises(IsADirectoryError, match="/workspace/a"):
        sandbox.read_file("/workspace/a")
    with pytest.raises(NotADirectoryError):
        sandbox.list_dir("/workspace/run.sh")
    with pytest.raises(PermissionError, match="/etc/passwd"):
        sandbox.write_file("/etc/passwd", "root::0:0::/:/bin/sh\n")
    with pytest.raises(PermissionError):
        sandbox.write_file("/newdir/x", "x")
    with pytest.raises(OSError, match="not a regular file"):
        sandbox.read_file("/workspace/fifo")
    sandbox.exec("chmod 000 secret")
    with pytest.raises(PermissionError):
        sandbox.read_file("secret")


def _change_everything(sb):
    """Edit, delete, add, chmod, rename a folder, delete a whole folder of a lower layer, replace a file by a folder."""
    r = sb.exec("""set -e
        echo edited >> /workspace/proj/main.py
        rm /workspace/proj/util.py
        echo new > /workspace/proj/new.py
        chmod 700 /workspace/proj/run.sh
        mv /workspace/proj/pkg /workspace/proj/pkg2
        rm -rf /workspace/data
        rm /workspace/link && mkdir /workspace/link
        rm /workspace/gone.txt; mkdir -p /tmp/t; echo t > /tmp/t/x
        touch -d 2001-01-01 /workspace/proj/main.py""")
    assert r.exit_code == 0, r.stderr


def test_snapshot_change_restore_gives_back_the_exact_tree(sandbox, tree):
    setup = sandbox.exec("""set -e
        mkdir -p proj/pkg/sub data/deep/er
        for i in 1 2 3; do echo "$i" > proj/pkg/sub/f$i; echo d$i > data/deep/er/d$i; done
        echo 'print(1)' > proj/main.py; echo util > proj/util.py; printf '#!/bin/sh\\n' > proj/run.sh
        chmod 755 proj/run.sh; ln -s proj/main.py link; echo gone > gone.txt""")
    assert setup.exit_code == 0, setup.stderr
    first = sandbox.snapshot()  # the tree now lives in a lower layer
    before = tree(sandbox)
    assert any(line.startswith("/workspace/data/deep/er/d3 ") for line in before)
    _change_everything(sandbox)
    second = sandbox.snapshot()  # whiteouts and an opaque folder in this one
    changed = tree(sandbox)
    assert changed != before and not any(line.startswith("/workspace/data") for line in changed)
    sandbox.exec("echo more > /workspace/more; rm -rf /workspace/proj")
    sandbox.restore(first)
    assert tree(sandbox) == before
    sandbox.restore(second)
    assert tree(sandbox) == changed
    assert len(second.layers) == len(first.layers) + 1


def test_forks_never_see_each_others_writes(sandbox):
    sandbox.write_file("/workspace/parent", "p")
    kids = sandbox.fork(n=3)
    try:
        assert all(isinstance(k, namespace_sandbox.NamespaceSandbox) and k.state is State.RUNNING for k in kids)
        for i, kid in enumerate(kids):
            kid.write_file("/workspace/parent", f"changed by {i}")
            kid.write_file(f"/workspace/kid{i}", str(i))
        for i, kid in enumerate(kids):
            assert sorted(e.name for e in kid.list_dir()) == sorted(["parent", f"kid{i}"])
            assert kid.read_file("/workspace/parent") == f"changed by {i}".encode()
        assert [e.name for e in sandbox.list_dir()] == ["parent"] and sandbox.read_file("parent") == b"p"
        sandbox.write_file("/workspace/late", "after the fork")
        assert kids[0].exec("test -e /workspace/late").exit_code != 0
        ref = kids[1].snapshot()
        (grandkid,) = sandbox.fork(ref)  # any sandbox of the backend can fork any of its refs
        assert grandkid.read_file("kid1") == b"1" and grandkid.read_file("parent") == b"changed by 1"
        grandkid.close()
    finally:
        for kid in kids:
            kid.close()


def test_a_chain_of_50_snapshots_restores_any_link(sandbox):
    refs = []
    for i in range(50):
        r = sandbox.exec(f"echo {i} > step; rm -f f{i - 1}; echo {i} > f{i}; mkdir -p d/{i}")
        assert r.exit_code == 0
        refs.append(sandbox.snapshot())
    assert max(len(r.layers) for r in refs) <= 33  # flattened past 32
    assert len(refs[40].layers) < 40
    for i in sorted(random.Random(13).sample(range(50), 7)) + [0, 49, 32, 33]:
        sandbox.restore(refs[i])
        listing = sandbox.exec("cat step; ls; ls d | sort -n | tr '\\n' ' '").stdout.split("\n")
        assert listing[0] == str(i)
        assert sorted(listing[1:-1]) == sorted(["d", "step", f"f{i}"])
        assert listing[-1].split() == [str(j) for j in range(i + 1)]


def test_snapshot_refuses_running_processes_unless_told_to_stop_them(sandbox):
    assert sandbox.exec("sleep 100 >/dev/null 2>&1 &").exit_code == 0
    with pytest.raises(SandboxBusy, match="sleep 100"):
        sandbox.snapshot()
    assert sandbox.stats()["pids"] == 1
    ref = sandbox.snapshot(stop_processes=True)
    assert sandbox.stats()["pids"] == 0 and ref.layers == ()
    with pytest.raises(Unsupported, match="files only"):
        sandbox.snapshot(memory=True)


BUSY = """
import time
count, last, gap = 0, time.monotonic(), 0.0
while True:
    count += 1
    if count % 20000 == 0:
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        with open("/tmp/progress.tmp", "w") as f:
            f.write(f"{count} {gap}")
        import os; os.replace("/tmp/progress.tmp", "/tmp/progress")
"""


def _progress(sb):
    count, gap = sb.read_file("/tmp/progress").split()
    return int(count), float(gap)


def test_pause_stops_progress_and_resume_continues_it(sandbox):
    sandbox.write_file("/tmp/busy.py", BUSY)
    sandbox.exec("python3 /tmp/busy.py >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while sandbox.exec("test -e /tmp/progress").exit_code and time.monotonic() < deadline:
        time.sleep(0.05)
    sandbox.pause()
    assert sandbox.state is State.PAUSED
    with pytest.raises(SandboxBusy, match="paused"):
        sandbox.exec("true")
    assert sandbox.stats()["pids"] == 1  # stats need no answer from inside
    time.sleep(0.8)
    sandbox.pause()  # idempotent
    sandbox.resume()
    assert sandbox.state is State.RUNNING
    time.sleep(0.3)
    count, gap = _progress(sandbox)
    assert gap >= 0.7  # the loop saw the clock jump: it got no CPU while paused
    time.sleep(0.3)
    assert _progress(sandbox)[0] > count


def test_state_machine_and_closed_sandbox(backend):
    sb = backend.create()
    assert sb.state is State.RUNNING
    sb.pause()
    for call in (lambda: sb.snapshot(), lambda: sb.fork(), lambda: sb.write_file("x", "x")):
        with pytest.raises(SandboxBusy):
            call()
    sb.close()  # from PAUSED
    assert sb.state is State.CLOSED
    sb.close()  # idempotent
    for call in (lambda: sb.exec("true"), lambda: sb.read_file("x"), lambda: sb.list_dir(), lambda: sb.stats(),
                 lambda: sb.snapshot(), lambda: sb.pause(), lambda: sb.resume(), lambda: sb.fork()):  # fmt: skip
        with pytest.raises(SandboxClosed):
            call()
    dying = backend.create()
    os.kill(dying.pid, signal.SIGKILL)  # its supervisor dies: the sandbox closes, calls say so
    with pytest.raises(SandboxClosed, match="died"):
        dying.exec("true")
    assert dying.state is State.CLOSED


def test_a_call_past_its_deadline_is_a_timeout_and_closes_the_sandbox(backend, monkeypatch):
    monkeypatch.setattr(namespace_sandbox, "EXEC_MARGIN_S", 0.3)
    stuck = backend.create()
    os.kill(stuck.pid, signal.SIGSTOP)  # a supervisor that no longer answers
    start = time.monotonic()
    with pytest.raises(SandboxTimeout, match="no answer to exec"):
        stuck.exec("true", timeout=0.2)
    assert time.monotonic() - start < 5 and stuck.state is State.CLOSED
    assert _gone(stuck.pid)


def test_a_sandbox_whose_descriptors_pass_fd_setsize_still_closes(backend, past_fd_setsize):
    """A fleet of some hundred sandboxes (the distillation benchmark's 576-episode evaluation) holds descriptors past
    select()'s FD_SETSIZE (1024); closing one waited with select() and raised "filedescriptor out of range"."""
    sb = backend.create()
    assert sb._pidfd > 1024
    pid = sb.pid
    sb.close()
    assert sb.state is State.CLOSED and _gone(pid)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """The process exited (its parent may take a moment to reap it)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False


def test_stats_report_usage_and_how_limits_are_enforced(make):
    sb = make(memory_mb=256, max_pids=64, cpus=0.5, disk_mb=32)
    sb.exec("head -c 5000000 /dev/urandom > /workspace/blob")
    s = sb.stats()
    assert s["disk_bytes"] >= 5_000_000 and s["memory_bytes"] > 5_000_000 and s["pids"] == 0
    assert s["limits"] == {"memory_mb": 256, "cpus": 0.5, "max_pids": 64, "disk_mb": 32}
    assert set(s["enforced"]) == {"memory", "pids", "cpu", "disk"} and all(s["enforced"].values())


KILLED = """
import json, sys, types, time
pkg = types.ModuleType("openk3"); pkg.__path__ = [sys.argv[1] + "/openk3"]; sys.modules["openk3"] = pkg  # no torch
from openk3.sandbox.namespace import NamespaceBackend
b = NamespaceBackend()
sbs = [b.create() for _ in range(3)]
sbs[0].write_file("x", "x")
sbs[0].snapshot()  # a layer in the state folder too
for sb in sbs:
    sb.exec("sleep 300 >/dev/null 2>&1 &")
print(json.dumps({"supervisors": [sb.pid for sb in sbs], "dir": b.dir, "id": b.id}), flush=True)
time.sleep(300)
"""


def _sandbox_processes(supervisors):
    """Host pid -> (pid namespace, mount namespace) of every process inside those supervisors' PID namespaces."""
    spaces = {os.readlink(f"/proc/{p}/ns/pid") for p in supervisors}
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = os.readlink(f"/proc/{pid}/ns/pid"), os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        if ns[0] in spaces or int(pid) in supervisors:
            out[int(pid)] = ns
    return out


def _all_namespaces():
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for kind in ("mnt", "pid", "net", "user"):
            try:
                found.add(os.readlink(f"/proc/{pid}/ns/{kind}"))
            except OSError:
                pass
    return found


def test_a_killed_backend_leaves_no_mounts_namespaces_or_processes(backend):
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().count("\n")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, REPO], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        inside = _sandbox_processes(info["supervisors"])
        assert len(inside) >= 6  # 3 supervisors, 3 sleeps
        spaces = {ns for pair in inside.values() for ns in pair}
        assert len(spaces) == 6  # each sandbox its own pid and mount namespaces
        cgroup_dirs = [f"/sys/fs/cgroup/{c}/openk3/{info['id']}" for c in ("memory", "pids")]
        assert all(os.path.isdir(d) for d in cgroup_dirs) == (backend.cgroups.mode == "v1")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alive = [p for p in inside if os.path.exists(f"/proc/{p}")]
        if not alive and not os.path.exists(info["dir"]) and not any(map(os.path.exists, cgroup_dirs)):
            break
        time.sleep(0.05)
    assert not [p for p in inside if os.path.exists(f"/proc/{p}")], "sandbox processes outlived their backend"
    assert not os.path.exists(info["dir"]) and not any(map(os.path.exists, cgroup_dirs))
    assert not spaces & _all_namespaces()
    with open("/proc/self/mountinfo") as f:
        assert f.read().count("\n") == mounts


def test_create_and_exec_are_fast_enough_to_be_warm(backend, sandbox):
    """Loose bounds (a shared 2-core machine): the issue's targets are measured by `k3 sandbox bench`."""
    times = []
    for _ in range(15):
        start = time.perf_counter()
        backend.create().close()
        times.append(time.perf_counter() - start)
    assert sorted(times)[7] < 0.5
    times = [sandbox.exec(["true"]).duration for _ in range(20)]
    assert sorted(times)[10] < 0.05


def test_async_calls(sandbox):
    async def agent():
        await sandbox.awrite_file("/workspace/a.txt", "async")
        results = await asyncio.gather(*(sandbox.aexec(f"cat a.txt; echo {i}") for i in range(4)))
        return [r.stdout for r in results]

    assert asyncio.run(agent()) == [f"async{i}\n" for i in range(4)]


def test_named_base_image_and_flattening_keep_its_deletions(tmp_path, tree):
    """A base image folder of the user's; deletions of its files and a folder replaced by a new one (opaque) survive
    the flattening of a long chain, which must keep them as whiteouts and opaque marks over the base."""
    base = build_skeleton(str(tmp_path / "image"))
    os.mkdir(os.path.join(base, "workspace", "dir"))
    for rel, text in (("keep", "k"), ("gone", "g"), ("dir/old", "o")):
        with open(os.path.join(base, "workspace", rel), "w") as f:
            f.write(text)
    for dirpath, dirs, files in os.walk(os.path.join(base, "workspace")):
        for name in dirs + files + [""]:
            os.chown(os.path.join(dirpath, name), 101000, 101000)
    with NamespaceBackend(base_image=base, max_pids=64) as b:
        sb = b.create()
        assert sb.read_file("keep") == b"k" and sb.read_file("dir/old") == b"o"
        assert sb.exec("rm gone; rm -rf dir; mkdir dir; echo n > dir/new").exit_code == 0
        first = sb.snapshot()
        expected = [line for line in tree(sb) if line.startswith("/workspace")]
        for i in range(34):  # past the flattening bound
            sb.exec(f"echo {i} > /tmp/step{i}")
            last = sb.snapshot()
        assert len(last.layers) < len(first.layers) + 34
        sb.restore(first)
        fresh = b.create(layers=last.layers)
        for s in (sb, fresh):
            assert [line for line in tree(s) if line.startswith("/workspace")] == expected
        assert fresh.exec("cat /tmp/step33; ls /workspace/dir; test -e /workspace/gone").stdout == "33\nnew\n"


NOT_ROOT = """
import sys, types
pkg = types.ModuleType("openk3"); pkg.__path__ = [sys.argv[1] + "/openk3"]; sys.modules["openk3"] = pkg
from openk3.sandbox import SandboxUnavailable, create_sandbox
try:
    create_sandbox()
except SandboxUnavailable as e:
    print("unavailable:", e)
"""


def test_a_host_that_forbids_it_says_why():
    """Without root (here: dropped to nobody) the backend cannot map uids: SandboxUnavailable, with the reason."""

    def drop():
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    python = "/usr/bin/python3"  # the system's: a virtual environment under /root is closed to nobody
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python}")
    r = subprocess.run([python, "-I", "-c", NOT_ROOT, REPO], capture_output=True, text=True, preexec_fn=drop,
                       check=False, cwd="/")  # fmt: skip
    assert r.stdout.startswith("unavailable: the namespace backend needs root"), r.stdout + r.stderr
