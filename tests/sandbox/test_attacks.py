"""Real attacks on the namespace backend, from inside a sandbox: escapes (host files, symlinks and `..`, /proc/1/root,
mounting, chroot, new namespaces, ptrace and kill of host processes, the network, rlimits, cgroup files, setuid
binaries) must fail, and resource attacks (fork bomb, memory bomb, disk fill, endless loop, 10,000 files, a 1 GB
write) must stay contained and be reported, while the host and another sandbox keep working."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import threading

import pytest

from openk3.sandbox import NamespaceBackend

PTRACE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for pid in map(int, sys.argv[1:]):
    rc = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    print(pid, rc, os.strerror(ctypes.get_errno()))
"""

MOUNT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for args in ((b"none", b"/tmp", b"tmpfs", 0, None), (b"/", b"/tmp", None, 4096, None), (None, b"/usr", None, 32 | 4096, None)):
    print(libc.mount(*args), os.strerror(ctypes.get_errno()))
print(libc.umount2(b"/usr", 2), os.strerror(ctypes.get_errno()))
print(libc.unshare(0x00020000), libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
"""


def _host_ok():
    assert subprocess.run(["true"], check=False).returncode == 0


def test_host_files_are_out_of_reach(sandbox, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("TOP-SECRET-HOST-DATA")
    with open("/etc/shadow") as f:
        shadow = f.readline().strip()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = sandbox.exec(f"""cat /etc/shadow; cat {secret}; ls {repo} {tmp_path}; cat /proc/1/root/etc/shadow;
        ls /proc/1/root/; ls -d /proc/1; cat /proc/1/environ; grep -r TOP-SECRET / --exclude-dir=proc --exclude-dir=usr""")
    out = r.stdout + r.stderr
    assert "TOP-SECRET-HOST-DATA" not in out and shadow not in out and "pyproject" not in out
    assert r.stdout == "" and "No such file" in r.stderr
    for path in ("/etc/shadow", str(secret), "/proc/1/root/etc/shadow", f"{repo}/pyproject.toml"):
        with pytest.raises(FileNotFoundError):
            sandbox.read_file(path)
    with pytest.raises(FileNotFoundError):
        sandbox.list_dir("/proc/1/root/")
    for path in ("/usr/bin/evil", "/etc/passwd", "/proc/sys/kernel/hostname", "/workspace/../etc/x"):
        with pytest.raises(OSError) as err:
            sandbox.write_file(path, "x")
        assert err.value.errno in (errno.EACCES, errno.EROFS), path
    assert sandbox.exec("touch /usr/bin/evil").exit_code != 0 and not os.path.exists("/usr/bin/evil")
    assert sandbox.exec(["sh", "-c", "grep -c '^' /proc/self/mountinfo"]).exit_code == 0


def test_symlinks_and_dotdot_stay_inside(sandbox, tmp_path):
    with open("/etc/passwd") as f:
        assert "sandbox:x:1000" not in f.read()  # so reading it below proves whose passwd it is
    assert sandbox.exec("ln -s / root; ln -s /etc/passwd pw; ln -s ../../../../../../etc up; "
                        f"ln -s {tmp_path} hostdir; mkdir -p {tmp_path}").exit_code == 0  # fmt: skip
    for path in (
        "/workspace/pw",
        "/workspace/up/passwd",
        "/workspace/root/etc/passwd",
        "/workspace/../../../../etc/passwd",
    ):
        assert b"sandbox:x:1000" in sandbox.read_file(path)
    sandbox.write_file("/workspace/../../../../tmp/dotdot", "x")
    sandbox.write_file("/workspace/hostdir/planted", "x")  # lands in the sandbox's own /tmp/pytest-... folder
    assert sandbox.read_file("/tmp/dotdot") == b"x" and not os.path.exists("/tmp/dotdot")
    assert not (tmp_path / "planted").exists()
    with pytest.raises(PermissionError):
        sandbox.write_file("/workspace/pw", "owned")
    r = sandbox.exec("cd ../../../../..; pwd; cat /workspace/up/passwd | grep -c sandbox")
    assert r.stdout == "/\n1\n"


def test_mount_unshare_chroot_and_setuid_are_refused(sandbox):
    for cmd in ("mount -t tmpfs none /tmp", "mount --bind / /tmp", "umount /usr", "umount -l /proc", "unshare -m true",
                "unshare -U true", "unshare -Ur true", "unshare -n true", "chroot / true", "su -c id",
                "/usr/bin/mount -t proc proc /tmp", "nsenter -t 1 -m true"):  # fmt: skip
        r = sandbox.exec(cmd)
        assert r.exit_code != 0, cmd
    out = sandbox.exec(["python3", "-c", MOUNT]).stdout.splitlines()
    assert all(line.startswith("-1 ") for line in out[:4]), out
    assert out[4].split()[:2] == ["-1", "-1"], out
    status = sandbox.exec("grep -E '^(NoNewPrivs|CapEff|CapPrm)' /proc/self/status").stdout.split()
    assert status == ["CapPrm:", "0000000000000000", "CapEff:", "0000000000000000", "NoNewPrivs:", "1"]


def test_host_processes_are_invisible_and_unkillable(sandbox, backend):
    me = os.getpid()
    targets = [me, 1, backend.zygote_pid]  # the test runner, the host's init, the zygote
    r = sandbox.exec(f"kill -9 {' '.join(map(str, targets))}")
    assert r.exit_code != 0 and r.stderr.count("kill:") == 3
    visible = "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [os.getpid()])"
    assert sandbox.exec(["python3", "-c", visible]).stdout == "True\n"  # not even its supervisor, PID 1
    traced = sandbox.exec(["python3", "-c", PTRACE, *map(str, targets)]).stdout.splitlines()
    assert all(" -1 " in line for line in traced), traced
    os.kill(me, 0)  # still here
    os.kill(targets[2], 0)
    _host_ok()


def test_no_network_but_its_own_loopback(sandbox):
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        udp.settimeout(0.3)
        tport, uport = tcp.getsockname()[1], udp.getsockname()[1]
        probe = f"""
import socket
for addr in (("127.0.0.1", {tport}), ("10.0.2.2", 80), ("8.8.8.8", 53), ("::1", {tport})):
    try:
        socket.create_connection(addr, timeout=2).close(); print("CONNECTED", addr)
    except OSError as e:
        print("refused", addr, e.errno)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b"hello", ("127.0.0.1", {uport}))
srv = socket.socket(); srv.bind(("127.0.0.1", 8080)); srv.listen(); c = socket.create_connection(("127.0.0.1", 8080))
print("own loopback ok")
"""
        r = sandbox.exec(["python3", "-c", probe])
        assert "CONNECTED" not in r.stdout and "own loopback ok" in r.stdout, r.stdout + r.stderr
        tcp.settimeout(0.3)
        with pytest.raises(TimeoutError):
            tcp.accept()
        with pytest.raises(TimeoutError):
            udp.recv(16)
    interfaces = sandbox.exec("tail -n +3 /proc/net/dev | cut -d: -f1").stdout.split()
    assert interfaces == ["lo"]


def test_limits_cannot_be_raised_nor_cgroups_written(make):
    sb = make(disk_mb=16)
    raise_ = """
import resource
for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE):  # the ones the sandbox sets
    soft, hard = resource.getrlimit(r)
    try:
        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); print("RAISED", r)
    except (ValueError, PermissionError) as e:
        print("refused", r)
print(resource.getrlimit(resource.RLIMIT_FSIZE)[1])
"""
    r = sb.exec(["python3", "-c", raise_])
    assert "RAISED" not in r.stdout and r.stdout.split()[-1] == str(32 << 20)  # twice the disk: sparse files
    for cmd in ("ulimit -f unlimited", "ls /sys/fs/cgroup", "echo 0 > /sys/fs/cgroup/pids/cgroup.procs",
                "echo -1000 > /proc/self/oom_score_adj", "echo 1 > /proc/sys/vm/drop_caches",
                "echo 99999 > /proc/sys/user/max_user_namespaces"):  # fmt: skip
        assert sb.exec(cmd).exit_code != 0, cmd


def test_fork_bombs_are_contained_and_reported(make, sandbox):
    sb = make(max_pids=32)
    r = sb.exec("f(){ f|f& }; f; sleep 1; sleep 1", timeout=10)
    assert r.limit == "pids", r
    assert sandbox.exec("echo neighbour").stdout == "neighbour\n"
    _host_ok()
    sb.snapshot(stop_processes=True)  # stops the bomb
    loop = "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    r = sb.exec(["python3", "-c", loop], timeout=20)
    forked, err = map(int, r.stdout.split())
    assert r.limit == "pids" and err == 11 and forked <= 32
    assert sb.stats()["pids"] <= 34


def test_memory_bomb_is_killed_and_reported(make, sandbox):
    sb = make(memory_mb=64)
    r = sb.exec(["python3", "-c", "a = []\nwhile True: a.append(bytearray(1 << 20))"], timeout=30)
    assert r.exit_code == 137 and r.limit == "memory", r
    assert sb.exec("echo survived").stdout == "survived\n"  # the supervisor was not the victim
    assert sandbox.exec("echo neighbour").stdout == "neighbour\n"
    _host_ok()


def test_disk_fill_gets_enospc_and_is_reported(make, sandbox):
    sb = make(disk_mb=16)
    r = sb.exec("dd if=/dev/zero of=/workspace/fill bs=64k", timeout=30)
    assert r.exit_code != 0 and r.limit == "disk" and "No space left" in r.stderr, r
    assert sb.stats()["disk_bytes"] >= 15 << 20
    with pytest.raises(OSError) as err:
        sb.write_file("/workspace/more", b"x" * (1 << 20))
    assert err.value.errno == errno.ENOSPC
    assert sb.exec("rm /workspace/fill; echo freed").stdout == "freed\n"
    assert sandbox.exec("echo neighbour").stdout == "neighbour\n"


def test_endless_loop_is_stopped_at_its_timeout(sandbox):
    r = sandbox.exec("while :; do :; done", timeout=1)
    assert r.timed_out and r.limit == "timeout" and r.exit_code == 137 and 1 <= r.duration < 4
    assert sandbox.exec("echo next").stdout == "next\n"


def test_ten_thousand_files(sandbox):
    make = "import os\nos.mkdir('many')\nfor i in range(10000):\n    open(f'many/f{i}', 'w').write(str(i))"
    assert sandbox.exec(["python3", "-c", make]).exit_code == 0
    assert len(sandbox.list_dir("/workspace/many")) == 10000
    ref = sandbox.snapshot()
    sandbox.exec("rm -rf many")
    sandbox.restore(ref)
    assert sandbox.exec("ls many | wc -l; cat many/f9999").stdout == "10000\n9999"


def test_a_1gb_write_is_cut_at_the_disk_limit_while_others_work(make, sandbox):
    sb = make(disk_mb=64)
    results = {}
    writer = threading.Thread(target=lambda: results.setdefault("w", sb.exec("head -c 1G /dev/zero > big", timeout=60)))
    writer.start()
    for i in range(5):  # the neighbour and the host keep answering meanwhile
        assert sandbox.exec(f"echo {i}").stdout == f"{i}\n"
        _host_ok()
    writer.join(60)
    r = results["w"]
    assert r.exit_code != 0 and r.limit == "disk", r
    assert sb.stats()["disk_bytes"] <= 65 << 20


def test_rlimit_fallback_without_cgroups():
    """What a host without writable cgroups gets: RLIMIT_AS, RLIMIT_NPROC (per user namespace, so per sandbox) and
    SIGSTOP for pause; stats say so."""
    with NamespaceBackend(cgroups=False) as backend:
        sb = backend.create(memory_mb=128, max_pids=16)
        assert sb.stats()["enforced"]["memory"].startswith("RLIMIT_AS")
        r = sb.exec(["python3", "-c", "a = []\nwhile True: a.append(bytearray(1 << 20))"], timeout=30)
        assert r.exit_code != 0 and r.limit == "memory", r
        r = sb.exec(
            ["python3", "-c", "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(20)"],
            timeout=20,
        )
        assert r.exit_code != 0 and r.limit == "pids", r
        sb.snapshot(stop_processes=True)
        sb.exec("sleep 30 >/dev/null 2>&1 &")
        sb.pause()
        assert sb.stats()["pids"] == 1
        sb.resume()
        other = backend.create()
        assert other.exec("echo fine").stdout == "fine\n"  # the first one's processes do not count against it
