"""A sandbox's supervisor: PID 1 of the sandbox's PID namespace, root of its user namespace (inside uid 0 = host uid
0 for files, so it can read the base image and write the layer store; no capability outside its namespaces), not
chrooted. It assembles the sandbox's mounts (rootfs.py), then serves the backend's requests on its socket, one at a
time: exec and file operations through children that become the sandbox user (jail.py), snapshot (freeze the
writable layer into a layer of the store, layers.py), restore, signals to every other process, and process stats
where there are no cgroups.

It is non-dumpable (the sandbox user cannot open /proc/1/root or /proc/1/mem, and hidepid hides PID 1 anyway) and
sets no_new_privs for everything it starts. If it dies, the kernel kills every process of the namespace and the
mounts vanish with the mount namespace.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import signal
import socket
import time

import cgroups
import jail
import layers
import linux as L
import wire
from rootfs import RootFs

MAX_LAYERS = 32  # a longer chain is flattened into one layer at the next snapshot
REFUSALS = {errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENODEV, errno.ENOSYS, errno.EOPNOTSUPP}
NOFILE = 1 << 16


class Supervisor:
    def __init__(self, cfg: dict, req: dict):
        lim = req["limits"]
        self.fs = RootFs(dict(cfg, disk_mb=lim["disk_mb"]), req["chain"])
        self.layers_dir = cfg["layers"]
        self.cgroup_mode = req["cgroup_mode"]
        self.memory_mb, self.max_pids = lim["memory_mb"], lim["max_pids"]
        self.events = {k: os.open(p, os.O_RDONLY) for k, p in req["events"].items()}

        def cap(res: int, value: int) -> int:
            hard = resource.getrlimit(res)[1]
            return value if hard == resource.RLIM_INFINITY else min(value, hard)

        # Lowered only: inside a user namespace nothing can raise a hard limit (CAP_SYS_RESOURCE of the host).
        # RLIMIT_FSIZE bounds the apparent size of sparse files (a layer copy keeps holes, but still); at twice the
        # disk, a real fill meets ENOSPC first, which is what a program expects of a full disk.
        fsize = cap(resource.RLIMIT_FSIZE, 2 * lim["disk_mb"] << 20)
        self.rlimits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, fsize),
                        (resource.RLIMIT_NOFILE, cap(resource.RLIMIT_NOFILE, NOFILE))]  # fmt: skip
        self.rlimits_exec = list(self.rlimits)
        if self.cgroup_mode is None:  # no cgroups: per-process address space and per-user (this namespace) processes
            if self.memory_mb is not None:
                self.rlimits_exec.append((resource.RLIMIT_AS, cap(resource.RLIMIT_AS, self.memory_mb << 20)))
            if self.max_pids is not None:
                self.rlimits_exec.append((resource.RLIMIT_NPROC, cap(resource.RLIMIT_NPROC, self.max_pids)))
        self.broken = None

    def setup(self) -> None:
        L.prctl(L.PR_SET_DUMPABLE, 0)
        L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
        L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)  # nothing we mount propagates anywhere
        socket.sethostname("sandbox")
        L.loopback_up()
        # No user namespace may be made inside this one: the sandbox user could otherwise gain capabilities there
        # (and with CAP_SYS_CHROOT walk out of its chroot into this mount namespace's host tree).
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
        self.fs.setup()

    def counters(self) -> tuple[int, int, int, bool]:
        """(OOM kills, forks refused at pids.max, writable-layer bytes, whether that layer is full)."""
        oom = pids = 0
        if "memory" in self.events:
            oom = cgroups.read_counter(os.pread(self.events["memory"], 4096, 0).decode(), "oom_kill")
        if "pids" in self.events:
            pids = cgroups.read_counter(os.pread(self.events["pids"], 4096, 0).decode(), "max")
        return (oom, pids, *self.fs.disk_usage())

    def _limit(self, before, after, code: int, timed_out: bool, err: bytes, truncated: bool) -> str | None:
        if timed_out:
            return "timeout"
        if after[0] > before[0]:
            return "memory"
        if after[1] > before[1]:
            return "pids"
        if code == 128 + signal.SIGXFSZ or (after[3] and (after[2] > before[2] or code != 0)):
            return "disk"
        if self.cgroup_mode is None:  # rlimits tell nobody; read the symptoms (best effort, see docs/sandbox.md)
            if self.memory_mb is not None and (b"MemoryError" in err or b"Cannot allocate memory" in err
                                               or b"out of memory" in err.lower()):  # fmt: skip
                return "memory"
            if self.max_pids is not None and (b"Resource temporarily unavailable" in err or b"fork: retry" in err):
                return "pids"
        return "output" if truncated else None

    def op_exec(self, h: dict, blobs: list[bytes]):
        before = self.counters()
        try:
            outs, cut, code, timed_out, duration = jail.exec_command(self.fs.root, self.rlimits_exec, h,
                                                                     blobs[0] if h["stdin"] else None)  # fmt: skip
        except jail.CwdError as e:
            return {"oserror": [e.errno, e.strerror, e.filename]}, []
        limit = self._limit(before, self.counters(), code, timed_out, outs[1], any(cut))
        reply = {"exit_code": code, "timed_out": timed_out, "duration": duration, "limit": limit, "truncated": any(cut)}
        return reply, outs

    def op_file(self, h: dict, blobs: list[bytes]):
        try:
            return {}, [jail.file_op(self.fs.root, self.rlimits, h, blobs[0] if blobs else None)]
        except OSError as e:
            return {"oserror": [e.errno, e.strerror, e.filename]}, []

    def kill_all(self, deadline_s: float = 10.0) -> None:
        """SIGKILL every process of the namespace but PID 1 (kill(-1) from PID 1 reaches exactly those) and reap."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            jail.reap()
            left = self.fs.processes()
            if not left:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"processes outlive SIGKILL: {self.fs.describe(left)}")
            time.sleep(0.0005)

    def op_snapshot(self, h: dict, _blobs):
        left = self.fs.processes()
        if left:
            if not h["stop"]:
                return {"busy": f"processes still run: {self.fs.describe(left)}"}, []
            self.kill_all()
        if self.fs.upper_empty():  # nothing changed since the chain's top: the snapshot is that chain
            return {"layers": self.fs.chain, "sizes": {}}, []
        self.fs.detach_root()
        chain, sizes = self.fs.chain + [h["layer"]], {}
        try:
            sizes[h["layer"]] = layers.copy_layer(self.fs.upper, os.path.join(self.layers_dir, h["layer"]))
            if len(chain) > MAX_LAYERS:
                tops = [os.path.join(self.layers_dir, lid) for lid in reversed(chain)]
                sizes[h["flat"]] = layers.flatten(tops, os.path.join(self.layers_dir, h["flat"]))
                chain = [h["flat"]]
        except BaseException:
            self._guard(self.fs.mount_root)  # the sandbox goes on as it was: same writable layer, same chain
            raise
        self._guard(self.fs.remount, chain)
        return {"layers": chain, "sizes": sizes}, []

    def op_restore(self, h: dict, _blobs):
        self.kill_all()
        self._guard(self.fs.remount, h["layers"])
        return {}, []

    def _guard(self, fn, *args) -> None:
        """Mounts that fail half-way leave no sandbox to go on with: answer, then exit (the sandbox closes)."""
        try:
            fn(*args)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def op_signal(self, h: dict, _blobs):
        try:
            os.kill(-1, h["sig"])  # from PID 1: every other process of the namespace
        except ProcessLookupError:
            pass
        return {}, []

    def op_stats(self, _h, _blobs):
        """Processes and their resident memory from the sandbox's own /proc (used where there are no cgroups)."""
        pids, rss = self.fs.processes(), 0
        for pid in pids:
            try:
                with open(os.path.join(self.fs.root, "proc", str(pid), "statm")) as f:
                    rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError):
                pass  # it exited meanwhile
        return {"pids": len(pids), "memory_bytes": rss, "disk_bytes": self.fs.disk_usage()[0]}, []

    def serve(self, sock: socket.socket) -> None:
        ops = {"exec": self.op_exec, "write_file": self.op_file, "read_file": self.op_file, "list_dir": self.op_file,
               "snapshot": self.op_snapshot, "restore": self.op_restore, "signal": self.op_signal,
               "stats": self.op_stats}  # fmt: skip
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while True:
            if not poller.poll(1000):
                jail.reap()  # orphans re-parented to PID 1 while nobody asked anything
                continue
            try:
                h, blobs, _ = wire.recv(sock)
            except OSError:  # the backend is gone: PID 1 exits and the kernel kills the rest of the namespace
                os._exit(0)
            try:
                reply, out = ops[h["op"]](h, blobs)
            except Exception as e:  # noqa: BLE001 (every request gets an answer)
                reply, out = {"error": f"{h.get('op')}: {type(e).__name__}: {e}"}, []
            jail.reap()
            if self.broken:
                reply = {"error": f"{h.get('op')}: the sandbox's mounts broke ({self.broken})", "dead": True}
            wire.send(sock, reply, out)
            if self.broken:
                os._exit(1)


def main(sock: socket.socket, go_fd: int, cfg: dict, req: dict) -> None:
    """Run as the first process of a new sandbox (forked by the zygote's middle process, which moves us into the
    sandbox's cgroups and then writes to `go_fd`). Never returns."""
    try:
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)  # the middle process dies with the zygote: so do we
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        err = None
        try:
            sup = Supervisor(cfg, req)
            sup.setup()
        except Exception as e:  # noqa: BLE001
            # a mount or namespace call the kernel refuses: this host cannot run sandboxes (not a passing failure)
            refused = isinstance(e, OSError) and e.errno in REFUSALS
            err = {"error": f"sandbox setup failed: {type(e).__name__}: {e}", "unavailable": refused}
        if os.read(go_fd, 1) != b"g":  # not in our cgroups: never serve
            os._exit(1)
        os.close(go_fd)
        wire.send(sock, err or {"ok": True})
        if err:
            os._exit(1)
        sup.serve(sock)
    finally:
        os._exit(1)
