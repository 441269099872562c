"""One sandbox of the namespace backend, seen from the host: the `Sandbox` protocol as requests to its supervisor over
a Unix socket (wire.py), one at a time, each under a deadline. Pause and resume go straight to the freezer cgroup
(the supervisor freezes with its sandbox), stats straight to the cgroups, so neither needs an answer from inside.

A supervisor that dies (its socket ends) makes the sandbox CLOSED; a call past its deadline is a SandboxTimeout and
the sandbox is killed (it cannot be trusted to be in a known state after that).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from openk3.sandbox import wire
from openk3.sandbox.base import (
    CALL_DEADLINE_S,
    DEFAULT_TIMEOUT_S,
    DirEntry,
    ExecResult,
    Sandbox,
    SandboxBusy,
    SandboxClosed,
    SandboxError,
    SandboxTimeout,
    SnapshotRef,
    State,
    Unsupported,
)

if TYPE_CHECKING:
    from openk3.sandbox.namespace import NamespaceBackend

EXEC_MARGIN_S = 10.0  # past an exec's own timeout, the supervisor's kill and drain get this long
EXIT_WAIT_S = 10.0


def _new_id() -> str:
    return os.urandom(8).hex()


class NamespaceSandbox(Sandbox):
    def __init__(self, backend: NamespaceBackend, sid: str, sock: socket.socket, pid: int, pidfd: int,
                 layers: tuple[str, ...], limits: dict):  # fmt: skip
        self.id, self.state, self.limits = sid, State.RUNNING, limits
        self.layers = layers  # the snapshot chain it stands on (its backend refuses to delete these)
        self.pid = pid  # the supervisor's host pid
        self.closed_reason: str | None = None
        self._backend, self._sock, self._pidfd = backend, sock, pidfd
        self._lock = threading.RLock()  # one request at a time on the socket (re-entered by _shutdown on failure)
        self._state_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NamespaceSandbox({self.id!r}, {self.state.value}, layers={len(self.layers)})"

    def _check(self, paused_ok: bool = False) -> None:
        if self.state is State.CLOSED:
            raise SandboxClosed(f"sandbox {self.id} is closed ({self.closed_reason})")
        if self.state is State.PAUSED and not paused_ok:
            raise SandboxBusy(f"sandbox {self.id} is paused: resume() it first")

    def _exchange(self, header: dict, blobs=(), deadline: float = CALL_DEADLINE_S) -> tuple[dict, list[bytes]]:
        op = header["op"]
        try:
            self._sock.settimeout(deadline)
            wire.send(self._sock, header, blobs)
            reply, out, _ = wire.recv(self._sock)
        except TimeoutError:
            self._shutdown(f"no answer to {op} within {deadline:g} s")
            raise SandboxTimeout(f"sandbox {self.id}: no answer to {op} within {deadline:g} s; it was closed") from None
        except OSError:
            self._shutdown(self.closed_reason or "its supervisor died")
            raise SandboxClosed(f"sandbox {self.id} is closed ({self.closed_reason})") from None
        if "error" in reply:
            if reply.get("dead"):
                self._shutdown(reply["error"])
            raise SandboxError(f"sandbox {self.id}: {reply['error']}")
        if "busy" in reply:
            raise SandboxBusy(f"sandbox {self.id}: {reply['busy']} (pass stop_processes=True to stop them)")
        if "oserror" in reply:
            raise OSError(*reply["oserror"])
        return reply, out

    def _call(self, header: dict, blobs=(), deadline: float = CALL_DEADLINE_S, paused_ok: bool = False):
        with self._lock:
            self._check(paused_ok)
            return self._exchange(header, blobs, deadline)

    def exec(self, cmd: str | list[str], timeout: float = DEFAULT_TIMEOUT_S, stdin: str | bytes | None = None,
             env: dict[str, str] | None = None, cwd: str = "/workspace") -> ExecResult:  # fmt: skip
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"cmd={cmd!r}: a shell string or a non-empty list of strings")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be positive")
        env = dict(env or {})
        if not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k for k, v in env.items()):
            raise ValueError(f"env={env!r}: names and values must be strings (no '=' in a name)")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        header = {"op": "exec", "argv": argv, "timeout": float(timeout), "env": env, "cwd": cwd,
                  "stdin": data is not None}  # fmt: skip
        reply, (out, err) = self._call(header, [data] if data is not None else [], deadline=timeout + EXEC_MARGIN_S)
        return ExecResult(reply["exit_code"], out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                          reply["timed_out"], reply["duration"], reply["limit"], reply["truncated"])  # fmt: skip

    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise ValueError(f"mode={mode!r}: permission bits, 0 to 0o7777")
        data = data.encode() if isinstance(data, str) else bytes(data)
        self._call({"op": "write_file", "path": path, "mode": mode}, [data])

    def read_file(self, path: str) -> bytes:
        return self._call({"op": "read_file", "path": path})[1][0]

    def list_dir(self, path: str = "/workspace") -> list[DirEntry]:
        return [DirEntry(*e) for e in json.loads(self._call({"op": "list_dir", "path": path})[1][0])]

    def snapshot(self, *, stop_processes: bool = False, memory: bool = False) -> SnapshotRef:
        self._check()
        if memory:
            raise Unsupported("the namespace backend snapshots files only (the overlay layers), never process memory; "
                              "a VM backend will carry memory")  # fmt: skip
        header = {"op": "snapshot", "stop": stop_processes, "layer": _new_id(), "flat": _new_id()}
        reply, _ = self._call(header)
        with self._backend._lock:
            self._backend._sizes.update(reply["sizes"])
            self.layers = tuple(reply["layers"])
        return SnapshotRef(_new_id(), self.layers, self._backend.node, created=time.time())

    def restore(self, ref: SnapshotRef) -> None:
        self._check()
        self._backend.check_ref(ref)
        with self._lock:
            self._check()
            old, self.layers = self.layers, tuple(ref.layers)  # claimed first: a GC must not take them meanwhile
            try:
                self._exchange({"op": "restore", "layers": list(ref.layers)})
            except SandboxError:
                self.layers = old
                raise

    def fork(self, ref: SnapshotRef | None = None, n: int = 1) -> list[Sandbox]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n={n!r}: must be a positive integer")
        self._check()
        if ref is None:
            ref = self.snapshot()
        self._backend.check_ref(ref)
        return self._backend._create_many(n, ref.layers, self.limits)

    def pause(self) -> None:
        with self._lock:  # waits for a call in flight: its supervisor must not freeze half-way through it
            self._check(paused_ok=True)
            if self.state is State.PAUSED:
                return
            if self._backend.cgroups.mode:
                self._freeze(True)
            else:  # from PID 1, kill(-1) stops every other process of the namespace
                self._exchange({"op": "signal", "sig": int(signal.SIGSTOP)})
            self.state = State.PAUSED

    def resume(self) -> None:
        with self._lock:
            self._check(paused_ok=True)
            if self.state is State.RUNNING:
                return
            if self._backend.cgroups.mode:
                self._freeze(False)
            else:
                self._exchange({"op": "signal", "sig": int(signal.SIGCONT)})
            self.state = State.RUNNING

    def _freeze(self, frozen: bool) -> None:
        """The freezer cgroup holds the supervisor too: a frozen sandbox answers nothing until thawed."""
        try:
            self._backend.cgroups.freeze(self.id, frozen)
        except TimeoutError as e:
            raise SandboxTimeout(f"sandbox {self.id}: {e}") from None
        except OSError:
            self._check(paused_ok=True)  # its groups went with it: SandboxClosed
            raise

    def stats(self) -> dict:
        self._check(paused_ok=True)
        cg = self._backend.cgroups
        if cg.mode:
            try:
                memory, pids = cg.usage(self.id)
                st = os.statvfs(f"/proc/{self.pid}/root{self._backend.dir}/mnt/disk")  # in the sandbox's mount ns
            except OSError:
                self._check()
                raise
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            out = {"memory_bytes": memory, "disk_bytes": used, "pids": max(0, pids - 1)}  # less the supervisor
        else:
            out = self._call({"op": "stats"}, paused_ok=True)[0]
        return dict(out, limits=dict(self.limits), enforced=self._backend.enforced(self.limits))

    def close(self) -> None:
        self._shutdown("closed by the caller")

    def _shutdown(self, reason: str, wait: bool = True) -> None:
        """Kill the supervisor (PID 1: the kernel kills the rest of the namespace, and its mounts go with it), wait
        for it, remove the cgroups. Idempotent; `wait=False` only sends the kill (a backend closing many at once)."""
        with self._state_lock:
            if self.state is not State.CLOSED:
                paused = self.state is State.PAUSED
                self.state, self.closed_reason = State.CLOSED, reason
                if paused and self._backend.cgroups.mode:
                    try:  # a frozen process takes its SIGKILL only once thawed
                        self._backend.cgroups.freeze(self.id, False, deadline_s=2.0)
                    except (OSError, TimeoutError):
                        pass
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not wait or self._pidfd < 0:
                return
            # readable once it (and its namespace) is gone; poll, not select: select() refuses descriptors past
            # FD_SETSIZE (1024), which a fleet of some hundred sandboxes (a pidfd and a socket each) passes
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            poller.poll(EXIT_WAIT_S * 1000)
            os.close(self._pidfd)
            self._pidfd = -1
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a call blocked on it in another thread
        except OSError:
            pass
        if self._lock.acquire(timeout=EXIT_WAIT_S):
            self._sock.close()
            self._lock.release()
        self._backend._forget(self)
