"""An in-memory test double of a sandbox backend, for the fleet's own logic (pool, capacity, reclaim, layer GC, metrics)
on any host: files are dicts, layers are frozen dicts in a store, `exec` only echoes. Tests only; never shipped.

It follows the namespace backend's contract: `create()`, `layers() -> {id: bytes}`, `delete_layers(ids)` (refusing
a layer a live sandbox stands on, as a mounted overlay would), `close()`; sandboxes snapshot their writable layer
into a new store layer, restore and fork stack a new writable layer over a ref's layers.
"""

from __future__ import annotations

import itertools
import threading
import time

from openk3.sandbox.base import DirEntry, ExecResult, Sandbox, SandboxClosed, SnapshotRef, State, Unsupported

_ids = itertools.count()


class DoubleBackend:
    def __init__(self, create_delay_s: float = 0.0, node: str = "local"):
        self.create_delay_s, self.node = create_delay_s, node
        self.store: dict[str, dict[str, bytes]] = {}
        self.sandboxes: dict[str, DoubleSandbox] = {}
        self.created = 0
        self.closed = False
        self.lock = threading.Lock()
        self.hold: threading.Event | None = None  # when set up: fresh creates wait for it, forks for one to start
        self.entered = threading.Event()

    def create(self, layers: tuple[str, ...] = ()) -> DoubleSandbox:
        time.sleep(self.create_delay_s)
        if self.hold is not None and not layers:  # a test orders a fresh create after a fork (see fork)
            self.entered.set()
            assert self.hold.wait(timeout=10)
        with self.lock:
            sb = DoubleSandbox(self, f"sb{next(_ids)}", layers)
            self.sandboxes[sb.id] = sb
            self.created += 1
        return sb

    def layers(self) -> dict[str, int]:
        with self.lock:
            return {lid: sum(map(len, files.values())) for lid, files in self.store.items()}

    def delete_layers(self, ids) -> None:
        with self.lock:
            for lid in ids:
                users = [s.id for s in self.sandboxes.values() if lid in s.stack and s.state is not State.CLOSED]
                assert not users, f"layer {lid} is mounted by {users}"
                del self.store[lid]

    def alive(self) -> list[str]:
        with self.lock:
            return [s.id for s in self.sandboxes.values() if s.state is not State.CLOSED]

    def close(self) -> None:
        self.closed = True
        for sb in list(self.sandboxes.values()):
            sb.close()


class DoubleSandbox(Sandbox):
    def __init__(self, backend: DoubleBackend, sid: str, stack: tuple[str, ...]):
        self.id, self.state, self.stack = sid, State.RUNNING, tuple(stack)
        self.backend = backend
        self.upper: dict[str, bytes] = {}

    def _check(self) -> None:
        if self.state is State.CLOSED:
            raise SandboxClosed(self.id)

    def _files(self) -> dict[str, bytes]:
        files = {}
        for lid in self.stack:
            files.update(self.backend.store[lid])
        files.update(self.upper)
        return files

    def exec(self, cmd, timeout=30.0, stdin=None, env=None, cwd="/workspace") -> ExecResult:
        self._check()
        if cmd == ["sleep"]:  # a call that takes a while: the fleet must not reclaim a busy sandbox
            time.sleep(timeout)
        return ExecResult(0, cmd if isinstance(cmd, str) else " ".join(cmd), "", False, 0.0)

    def write_file(self, path, data, mode=0o644) -> None:
        self._check()
        self.upper[path] = data.encode() if isinstance(data, str) else data

    def read_file(self, path) -> bytes:
        self._check()
        files = self._files()
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    def list_dir(self, path="/workspace") -> list[DirEntry]:
        self._check()
        return [DirEntry(p, "file", len(d), 0o644) for p, d in sorted(self._files().items())]

    def snapshot(self, *, stop_processes=False, memory=False) -> SnapshotRef:
        self._check()
        if memory:
            raise Unsupported("files only")
        lid = f"L{next(_ids)}"
        with self.backend.lock:
            self.backend.store[lid] = dict(self.upper)
        self.stack, self.upper = self.stack + (lid,), {}
        return SnapshotRef(f"snap-{lid}", self.stack, self.backend.node, time.time())

    def restore(self, ref) -> None:
        self._check()
        assert all(lid in self.backend.store for lid in ref.layers), "restore of a deleted layer"
        self.stack, self.upper = ref.layers, {}

    def fork(self, ref=None, n=1) -> list[Sandbox]:
        self._check()
        ref = ref or self.snapshot()
        assert all(lid in self.backend.store for lid in ref.layers), "fork of a deleted layer"
        if self.backend.hold is not None:
            assert self.backend.entered.wait(timeout=10), "no fresh create started during the fork"
        return [self.backend.create(ref.layers) for _ in range(n)]

    def pause(self) -> None:
        self._check()
        self.state = State.PAUSED

    def resume(self) -> None:
        self._check()
        self.state = State.RUNNING

    def close(self) -> None:
        self.state = State.CLOSED

    def stats(self) -> dict:
        self._check()
        return {"memory_bytes": 1 << 20, "disk_bytes": sum(map(len, self.upper.values())), "pids": 1}
