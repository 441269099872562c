"""The zygote: one small stdlib-only process per namespace backend (run as `python3 -I -S zygote.py CONFIG`, so it never
imports openk3 or torch), which forks every sandbox. Forking from a small warm process is what makes a sandbox cheap.

For each "create" it makes the sandbox's cgroups and a socket pair, and forks a middle process A, which unshares a
user namespace; the zygote (host root) writes A's uid/gid maps (inside 0 -> host 0, inside 1..65535 -> host
100001..165535, the same in every sandbox so layers keep their owners); A then unshares the mount, network, IPC, UTS
and PID namespaces and forks B, the supervisor (supervisor.py), PID 1 of the new PID namespace. A moves B into the
cgroups, tells the backend B's host pid on the sandbox's socket, lets B go and waits for it. The backend gets its
end of the socket over the zygote's socket (SCM_RIGHTS) and talks to B directly from then on.

Lifetime: B dies with A, A with the zygote (PR_SET_PDEATHSIG), the zygote with the backend process (it watches a
pidfd of it: a death signal would follow the thread that started it, not the process). When it sees the backend
gone it kills its sandboxes and removes their cgroups and the backend's state folder.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling files, loaded as top-level modules

import cgroups
import linux as L
import supervisor
import wire

UID_MAP = "0 0 1\n1 100001 65535\n"
HANDSHAKE_S = 10.0


class Refused(OSError):
    """The host refuses what a sandbox needs (a user namespace, say): the backend cannot run here at all."""


class Zygote:
    def __init__(self, cfg: dict, sock: socket.socket):
        self.cfg, self.sock = cfg, sock
        self.cg = cgroups.Cgroups(cfg["backend_id"], enabled=cfg["cgroups"])
        self.children: dict[int, str] = {}  # middle process pid -> sandbox id

    def _events(self, sid: str) -> dict[str, str]:
        if self.cg.mode is None:
            return {}
        return {"memory": self.cg.path(sid, "memory.events"), "pids": self.cg.path(sid, "pids.events")}

    def create(self, req: dict) -> socket.socket:
        sid = req["sid"]
        if self.cg.mode:
            lim = req["limits"]
            self.cg.create(sid, lim["memory_mb"], lim["cpus"], lim["max_pids"])
        req = dict(req, cgroup_mode=self.cg.mode, events=self._events(sid))
        procs = [os.open(p, os.O_WRONLY) for p in self.cg.procs(sid)] if self.cg.mode else []
        be, sv = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        (up_r, up_w), (map_r, map_w) = os.pipe(), os.pipe()
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                keep = {sv.fileno(), up_w, map_r, *procs, 0, 1, 2}
                for fd in range(3, max(keep) + 1):  # the zygote's own sockets and pidfd stay with the zygote
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                os.closerange(max(keep) + 1, 1 << 16)
                self._middle(me, sv, up_w, map_r, procs, req)
            finally:
                os._exit(1)
        self.children[pid] = sid
        for fd in (up_w, map_r, *procs):
            os.close(fd)
        sv.close()
        try:
            ready, _, _ = select.select([up_r], [], [], HANDSHAKE_S)
            msg = os.read(up_r, 4096) if ready else b"Eno answer from the sandbox's first process"
            if msg != b"u":
                raise Refused(msg[1:].decode(errors="replace") or "the sandbox's first process died")
            for name, text in (("setgroups", "deny"), ("uid_map", UID_MAP), ("gid_map", UID_MAP)):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(text)
            os.write(map_w, b"m")
        except BaseException:
            be.close()
            os.kill(pid, signal.SIGKILL)
            if self.cg.mode:
                self.cg.remove(sid, deadline_s=1.0)  # nothing was moved in yet
            raise
        finally:
            os.close(up_r)
            os.close(map_w)
        return be

    def _middle(self, zygote: int, sv: socket.socket, up_w: int, map_r: int, procs: list[int], req: dict) -> None:
        """Process A: the new user namespace's first process; B's parent, outside B's PID namespace."""
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:  # the zygote died before the line above
            os._exit(1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        try:
            L.unshare(L.CLONE_NEWUSER)
        except OSError as e:
            os.write(up_w, b"E" + f"{e} (are user namespaces allowed? user.max_user_namespaces)".encode())
            os._exit(1)
        os.write(up_w, b"u")
        if os.read(map_r, 1) != b"m":
            os._exit(1)
        try:
            L.unshare(L.CLONE_NEWNS | L.CLONE_NEWNET | L.CLONE_NEWIPC | L.CLONE_NEWUTS | L.CLONE_NEWPID)
        except OSError as e:
            wire.send(sv, {"error": f"namespaces: {e}", "unavailable": True})
            os._exit(1)
        go_r, go_w = os.pipe()
        b = os.fork()
        if b == 0:
            os.close(go_w)
            for fd in (up_w, map_r, *procs):
                os.close(fd)
            supervisor.main(sv, go_r, self.cfg, req)
        os.close(go_r)
        try:
            for fd in procs:
                os.write(fd, str(b).encode())
        except OSError as e:
            wire.send(sv, {"error": f"cgroups: cannot move the supervisor in: {e}"})
            os.kill(b, signal.SIGKILL)
            os._exit(1)
        wire.send(sv, {"pid": b})
        os.write(go_w, b"g")
        for fd in (go_w, up_w, map_r, *procs):
            os.close(fd)
        sv.close()
        while True:
            try:
                os.waitpid(b, 0)
                os._exit(0)
            except InterruptedError:
                continue
            except ChildProcessError:
                os._exit(0)

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.pop(pid, None)

    def serve(self, backend_pidfd: int) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(backend_pidfd, select.POLLIN)
        while True:
            events = poller.poll(500)
            self.reap()
            for fd, _ in events:
                if fd == backend_pidfd:
                    return self.shutdown(cleanup=True)  # the backend died without closing us
                try:
                    req, _blobs, _fds = wire.recv(self.sock)
                except OSError:
                    return self.shutdown(cleanup=True)
                if req["op"] == "exit":
                    return self.shutdown(cleanup=False)
                try:
                    be = self.create(req)
                except Exception as e:  # noqa: BLE001
                    wire.send(self.sock, {"error": f"{type(e).__name__}: {e}", "unavailable": isinstance(e, Refused)})
                    continue
                wire.send(self.sock, {"ok": True}, fds=[be.fileno()])
                be.close()

    def shutdown(self, cleanup: bool) -> None:
        """Kill every sandbox (the middle processes; their supervisors follow by PDEATHSIG, and with each PID 1 its
        namespace), then remove the cgroups once their last process is gone. With `cleanup` (the backend died), also
        remove the state folder."""
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 10
        while self.children and time.monotonic() < end:
            self.reap()
            time.sleep(0.005)
        while self.cg.mode and time.monotonic() < end:  # a supervisor dies a moment after its parent
            self.cg.remove_backend()
            if not any(os.path.isdir(d) for d in self.cg.dirs.values()):
                break
            time.sleep(0.01)
        if cleanup:
            shutil.rmtree(self.cfg["state_dir"], ignore_errors=True)
        try:
            wire.send(self.sock, {"bye": True})
        except OSError:
            pass


def main() -> None:
    cfg = json.loads(sys.argv[1])
    sock = socket.socket(fileno=cfg["fd"])
    backend = cfg["backend_pid"]
    pidfd = os.pidfd_open(backend)
    if os.getppid() != backend:  # the backend died before we watched it
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C goes to the backend, which closes us
    os.setgroups([])  # no supplementary group of the host follows anyone into a sandbox
    L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
    zygote = Zygote(cfg, sock)
    wire.send(sock, {"ok": True, "cgroups": zygote.cg.mode, "cgroups_why": zygote.cg.why})
    gc.freeze()  # the heap as it is now is shared with every sandbox: keep the collector from touching (copying) it
    zygote.serve(pidfd)


if __name__ == "__main__":
    main()
