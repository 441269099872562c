"""The namespace backend: each sandbox is a process tree in its own user, mount, PID, network (loopback only), IPC and
UTS namespaces, on an overlay root (the snapshot chain's layers over a base image, a tmpfs writable layer), limited by
cgroups (rlimits where there are none), running as an unprivileged uid.

This file is the host side: `NamespaceBackend` owns a state folder, the layer store and one zygote process
(zygote.py, which forks every sandbox); `NamespaceSandbox` is the `Sandbox` protocol over a socket to the sandbox's
supervisor (supervisor.py). Snapshot = copy the writable layer into a new read-only layer (cost grows with what
changed, not with the workspace); restore = a fresh empty writable layer over a ref's chain (O(1)); fork = new
sandboxes on a ref's chain. Files only: no process memory (docs/sandbox.md).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Self

from openk3.sandbox import image, wire
from openk3.sandbox.base import (
    Sandbox,
    SandboxBusy,
    SandboxClosed,
    SandboxError,
    SandboxUnavailable,
    SnapshotRef,
    Unsupported,
)
from openk3.sandbox.cgroups import Cgroups, remove_tree, stale_backend_dirs
from openk3.sandbox.namespace_sandbox import NamespaceSandbox

STATE_ROOT = "/var/tmp/openk3-sandbox"
DEFAULT_DISK_MB = 1024
DEFAULT_MAX_PIDS = 4096  # a sandbox with no process limit at all could take every pid of the host
INODES = 200_000  # files the writable layer may hold
EXEC_MARGIN_S = 10.0  # past an exec's own timeout, the supervisor's kill and drain get this long
HANDSHAKE_S = 30.0
ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")


def _new_id() -> str:
    return secrets.token_hex(8)


def _check_limits(memory_mb=None, cpus=None, max_pids=None, disk_mb=None) -> dict:
    for name, value in (("memory_mb", memory_mb), ("max_pids", max_pids), ("disk_mb", disk_mb)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: must be a positive integer or None")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0):
        raise ValueError(f"cpus={cpus!r}: must be a positive number or None")
    return {"memory_mb": memory_mb, "cpus": cpus, "max_pids": max_pids, "disk_mb": disk_mb}


def _raise_for(reply: dict) -> None:
    """A create step's error: SandboxUnavailable where the host refused (no user namespaces, no overlay mount, ...)."""
    if "error" in reply:
        raise (SandboxUnavailable if reply.get("unavailable") else SandboxError)(f"create: {reply['error']}")


def _starttime(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _sweep(root: str) -> None:
    """Remove state folders and cgroups of backends whose process is gone (killed before it could clean up)."""
    alive = set()
    for e in os.scandir(root):
        try:
            with open(os.path.join(e.path, "owner")) as f:
                pid, start = f.read().split()
            if _starttime(int(pid)) == start:
                alive.add(e.name)
                continue
        except (OSError, ValueError):
            if time.time() - e.stat().st_mtime < 60:  # a backend still writing its owner file
                alive.add(e.name)
                continue
        shutil.rmtree(e.path, ignore_errors=True)
    for d in stale_backend_dirs(alive):
        pid = os.path.basename(d).split("-")[0]
        if not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):  # another state root's backend may still live
            remove_tree(d)


def _stop_zygote(sock: socket.socket, proc: subprocess.Popen, state_dir: str, cg: Cgroups) -> None:
    """Stop the zygote (it kills every sandbox left), then remove the cgroups and state folder. Runs once, from
    close() or when the backend is garbage-collected or the interpreter exits."""
    try:
        wire.send(sock, {"op": "exit"})
        sock.settimeout(10)
        wire.recv(sock)
    except OSError:
        pass
    sock.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    cg.remove_backend()
    shutil.rmtree(state_dir, ignore_errors=True)


class NamespaceBackend:
    """Sandboxes of one base image on this machine. Limits given here are every sandbox's defaults (None: no memory or
    CPU limit, 4096 processes, a 1024 MB writable layer); `create()` may override them. `cgroups=False` forces the
    rlimit fallback (what a host without writable cgroups gets)."""

    def __init__(self, base_image: str | None = None, memory_mb: int | None = None, cpus: float | None = None,
                 max_pids: int | None = None, disk_mb: int | None = None, *, state_dir: str | None = None,
                 node: str | None = None, cgroups: bool = True):  # fmt: skip
        max_pids = DEFAULT_MAX_PIDS if max_pids is None else max_pids
        self.limits = _check_limits(memory_mb, cpus, max_pids, DEFAULT_DISK_MB if disk_mb is None else disk_mb)
        base = image.check_image(base_image) if base_image is not None else None
        if os.geteuid() != 0:
            raise SandboxUnavailable("the namespace backend needs root: it maps each sandbox's uids 0..65535 onto host "
                                     "uids 0 and 100001..165535 (CAP_SETUID/CAP_SETGID of the host)")  # fmt: skip
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read().split():
                raise SandboxUnavailable("this kernel has no overlayfs (modprobe overlay)")
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"
        root = state_dir or STATE_ROOT
        os.makedirs(root, mode=0o700, exist_ok=True)
        _sweep(root)
        self.dir = os.path.join(root, self.id)
        self.layers_dir = os.path.join(self.dir, "layers")
        for sub in ("mnt/dev", "mnt/disk", "mnt/root", "layers"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o700)
        os.chmod(self.dir, 0o700)
        with open(os.path.join(self.dir, "owner"), "w") as f:
            f.write(f"{os.getpid()} {_starttime(os.getpid())}")
        self.base = base or image.build_skeleton(os.path.join(self.dir, "base"))
        self.node = node or f"{socket.gethostname()}/{self.id}"
        self.cgroups = Cgroups(self.id, enabled=cgroups)
        self.closed = False
        self._lock = threading.Lock()  # the zygote's socket and the bookkeeping below
        self._sandboxes: dict[str, NamespaceSandbox] = {}
        self._sizes: dict[str, int] = {}  # layer id -> data bytes, as the supervisor that wrote it counted
        cfg = {"backend_pid": os.getpid(), "backend_id": self.id, "state_dir": self.dir, "cgroups": cgroups,
               "mnt": os.path.join(self.dir, "mnt"), "layers": self.layers_dir, "base": self.base,
               "bind_usr": not image.has_own_usr(self.base), "inodes": INODES}  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cfg["fd"] = theirs.fileno()
        proc = subprocess.Popen([sys.executable, "-I", "-S", ZYGOTE, json.dumps(cfg)], pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        theirs.close()
        self._zsock, self.zygote_pid = ours, proc.pid
        self._finalizer = weakref.finalize(self, _stop_zygote, ours, proc, self.dir, self.cgroups)
        try:
            ours.settimeout(HANDSHAKE_S)
            hello, _, _ = wire.recv(ours)
            self.cgroup_mode = hello["cgroups"]
            self.create().close()  # the probe: anything this host forbids fails here, with its reason
        except SandboxUnavailable as e:
            self.close()
            raise SandboxUnavailable(f"the namespace backend cannot run here: {e}") from None
        except BaseException:  # anything else is a failure to report, not a host to skip
            self.close()
            raise

    def create(self, layers: tuple[str, ...] = (), **limits) -> NamespaceSandbox:
        """A new sandbox on the snapshot chain `layers` (bottom first; () = the bare base image)."""
        return self._create_many(1, tuple(layers), limits)[0]

    def _create_many(self, n: int, chain: tuple[str, ...], limits: dict) -> list[NamespaceSandbox]:
        lim = _check_limits(**{**self.limits, **{k: v for k, v in limits.items() if v is not None}})
        self._check_chain(chain)
        pending, made = [], []
        try:
            with self._lock:
                if self.closed:
                    raise SandboxClosed(f"backend {self.id} is closed")
                self._zsock.settimeout(HANDSHAKE_S)
                for _ in range(n):  # the zygote forks them one after another; their setups then run in parallel
                    sid = _new_id()
                    try:
                        wire.send(self._zsock, {"op": "create", "sid": sid, "chain": list(chain), "limits": lim})
                        reply, _, fds = wire.recv(self._zsock, want_fds=True)
                    except OSError as e:
                        raise SandboxError(f"backend {self.id}: its zygote does not answer ({e})") from None
                    _raise_for(reply)
                    pending.append((sid, socket.socket(fileno=fds[0])))
            while pending:
                made.append(self._handshake(*pending[0], chain, lim))
                pending.pop(0)
        except BaseException:
            for sb in made:
                sb.close()
            for sid, sock in pending:
                sock.close()  # its supervisor meets EOF and exits
                try:
                    self.cgroups.mode and self.cgroups.remove(sid)
                except OSError:
                    pass  # a supervisor slow to die: the zygote's shutdown or the next sweep removes the groups
            raise
        return made

    def _handshake(self, sid: str, sock: socket.socket, chain, lim: dict) -> NamespaceSandbox:
        sock.settimeout(HANDSHAKE_S)
        try:
            first, _, _ = wire.recv(sock)  # from the middle process: the supervisor's host pid
            pidfd = os.pidfd_open(first["pid"]) if "pid" in first else None
        except OSError as e:
            sock.close()
            raise SandboxError(f"create: the sandbox's first process failed ({e})") from None
        if pidfd is None:
            sock.close()
            _raise_for(first)
        sb = NamespaceSandbox(self, sid, sock, first["pid"], pidfd, tuple(chain), lim)
        with self._lock:
            self._sandboxes[sid] = sb
        try:
            hello, _, _ = wire.recv(sock)
        except OSError as e:
            hello = {"error": f"no answer from the supervisor ({e})"}
        if "error" in hello:
            sb._shutdown("setup failed")
            _raise_for(hello)
        return sb

    def _check_chain(self, chain) -> None:
        for lid in chain:
            if not isinstance(lid, str) or "/" in lid or not os.path.isdir(os.path.join(self.layers_dir, lid)):
                raise ValueError(f"layer {lid!r} is not in backend {self.id}'s store (deleted by a GC?)")

    def check_ref(self, ref: SnapshotRef) -> None:
        if ref.node != self.node:
            raise Unsupported(f"snapshot {ref.id} lives on node {ref.node!r}, not on this backend ({self.node!r})")
        self._check_chain(ref.layers)

    def layers(self) -> dict[str, int]:
        """The layer store: layer id -> data bytes."""
        with self._lock:
            return {e.name: self._sizes.get(e.name, 0) for e in os.scandir(self.layers_dir)
                    if e.is_dir() and not e.name.endswith(".tmp")}  # fmt: skip

    def delete_layers(self, ids) -> None:
        """Delete layers from the store; a layer a live sandbox stands on is refused (its overlay has it mounted)."""
        ids = list(ids)
        with self._lock:
            users = {lid: sb.id for sb in self._sandboxes.values() for lid in sb.layers}
            for lid in ids:
                if lid in users:
                    raise SandboxBusy(f"layer {lid} is mounted by sandbox {users[lid]}")
                if "/" in lid or lid.startswith("."):
                    raise ValueError(f"layer id {lid!r}")
            for lid in ids:
                shutil.rmtree(os.path.join(self.layers_dir, lid), ignore_errors=True)
                self._sizes.pop(lid, None)

    def enforced(self, lim: dict) -> dict:
        """How each limit is enforced on this host (None: that limit is not set)."""
        cg = f"cgroup {self.cgroup_mode}" if self.cgroup_mode else None
        pick = lambda key, with_cg, without: None if lim[key] is None else (f"{cg} {with_cg}" if cg else without)
        return {"memory": pick("memory_mb", "memory limit (processes and the writable layer's pages)", "RLIMIT_AS per process"),
                "pids": pick("max_pids", "pids.max", "RLIMIT_NPROC of the sandbox user in its user namespace"),
                "cpu": pick("cpus", "CFS quota", "not enforced (no cgroups)"),
                "disk": "tmpfs size of the writable layer, RLIMIT_FSIZE per file"}  # fmt: skip

    def _forget(self, sb: NamespaceSandbox) -> None:
        with self._lock:
            self._sandboxes.pop(sb.id, None)
        if self.cgroups.mode:
            try:
                self.cgroups.remove(sb.id)
            except OSError:
                pass  # the zygote's shutdown or the next backend's sweep removes it

    def close(self) -> None:
        """Close every sandbox, stop the zygote, remove the state folder (layers included). Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            live = list(self._sandboxes.values())
        for sb in live:
            sb._shutdown("its backend was closed", wait=False)
        for sb in live:
            sb._shutdown("its backend was closed")
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: dict[tuple[int, str | None], NamespaceBackend] = {}  # (pid, base image): a forked child starts its own
_shared_lock = threading.Lock()


def create_sandbox(backend: str = "namespace", base_image: str | None = None, memory_mb: int | None = None,
                   cpus: float | None = None, max_pids: int | None = None, disk_mb: int | None = None) -> Sandbox:  # fmt: skip
    """A sandbox from this process's shared backend for `base_image` (started on first use, kept warm, stopped at
    exit). Use as a context manager to close it."""
    if backend != "namespace":
        raise ValueError(f"backend={backend!r}: the backends are 'namespace'")
    _check_limits(memory_mb, cpus, max_pids, disk_mb)
    key = (os.getpid(), base_image)
    with _shared_lock:
        shared = _shared.get(key)
        if shared is None or shared.closed:
            shared = _shared[key] = NamespaceBackend(base_image)
    return shared.create(memory_mb=memory_mb, cpus=cpus, max_pids=max_pids, disk_mb=disk_mb)
