"""`k3 sandbox serve`: one `Fleet` behind a Unix socket, so that short-lived `k3 sandbox` commands can use sandboxes
that outlive them. A sandbox is a process tree owned by its backend, so a command that exits would take its sandboxes
with it; the server is the process that owns them. The user starts it and stops it (Ctrl-C or SIGTERM closes every
sandbox); nothing starts it implicitly. The socket is the user's alone (mode 0600).

Protocol, one JSON object per line each way:
    {"op": "create"}                                  -> {"ok": true, "result": {"id": ...}}
    {"op": "exec", "id", "cmd", "timeout", "stdin"}   -> ExecResult's fields
    {"op": "snapshot", "id", "stop"}                  -> SnapshotRef's fields
    {"op": "restore", "id", "snapshot"}               -> null
    {"op": "fork", "source": snapshot or sandbox id, "n"}   -> {"ids": [...]}
    {"op": "ls"}                                      -> {"sandboxes": [...], "snapshots": [...], "stats": {...}}
    {"op": "rm", "ids": [...]}                        -> {"removed": [...], "layers_deleted": [...]}
    {"op": "metrics"}                                 -> Prometheus text
    errors                                            -> {"ok": false, "error": class name, "message": ...}
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import socketserver
import tempfile
import threading
import time

from openk3.sandbox import base
from openk3.sandbox.fleet import Fleet


def default_socket() -> str:
    folder = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(folder, f"openk3-sandbox-{os.getuid()}.sock")


class FleetServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, fleet: Fleet, path: str):
        self.fleet, self.path = fleet, path
        if os.path.exists(path):
            if _listening(path):
                raise ValueError(f"a sandbox server already listens on {path}")
            os.unlink(path)  # left by a server that was killed
        old = os.umask(0o177)  # the socket file is created 0600: other users cannot drive our sandboxes
        try:
            super().__init__(path, _Handler)
        finally:
            os.umask(old)

    def server_close(self) -> None:
        super().server_close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def handle_op(self, req: dict):
        fleet, op = self.fleet, req["op"]
        if op == "create":
            return {"id": fleet.create().id}
        if op == "exec":
            r = self._sandbox(req["id"]).exec(req["cmd"], timeout=req.get("timeout", base.DEFAULT_TIMEOUT_S),
                                               stdin=req.get("stdin"))  # fmt: skip
            return dataclasses.asdict(r)
        if op == "snapshot":
            ref = self._sandbox(req["id"]).snapshot(stop_processes=req.get("stop", False))
            return dataclasses.asdict(ref)
        if op == "restore":
            return self._sandbox(req["id"]).restore(self._snapshot(req["snapshot"]))
        if op == "fork":
            refs = {r.id: r for r in fleet.snapshots()}
            source, n = req["source"], req.get("n", 1)
            kids = fleet.fork(refs[source], n) if source in refs else self._sandbox(source).fork(None, n)
            return {"ids": [k.id for k in kids]}
        if op == "ls":
            return self._listing()
        if op == "rm":
            return self._remove(req["ids"])
        if op == "metrics":
            return fleet.metrics()
        raise ValueError(f"unknown op {op!r}")

    def _sandbox(self, sid: str):
        for sb in self.fleet.sandboxes():
            if sb.id == sid:
                return sb
        raise ValueError(f"no live sandbox {sid!r} (see `k3 sandbox ls`)")

    def _snapshot(self, snap_id: str) -> base.SnapshotRef:
        for ref in self.fleet.snapshots():
            if ref.id == snap_id:
                return ref
        raise ValueError(f"no snapshot {snap_id!r} (see `k3 sandbox ls`)")

    def _listing(self) -> dict:
        now, rows = time.monotonic(), []
        for sb in self.fleet.sandboxes():
            try:
                s = sb.inner.stats()  # not sb.stats(): listing is no use of the sandbox, its idle clock runs on
            except base.SandboxError:
                continue
            rows.append({"id": sb.id, "state": sb.state.value, "idle_s": round(now - sb.last_used, 1),
                         "layers": len(sb.layers), "memory_bytes": s["memory_bytes"], "disk_bytes": s["disk_bytes"],
                         "pids": s["pids"]})  # fmt: skip
        snaps = [dataclasses.asdict(r) for r in self.fleet.snapshots()]
        return {"sandboxes": rows, "snapshots": snaps, "stats": self.fleet.stats()}

    def _remove(self, ids: list[str]) -> dict:
        live = {sb.id: sb for sb in self.fleet.sandboxes()}
        refs = {r.id: r for r in self.fleet.snapshots()}
        unknown = [i for i in ids if i not in live and i not in refs]
        if unknown:
            raise ValueError(f"no sandbox or snapshot {', '.join(unknown)} (see `k3 sandbox ls`)")
        for i in ids:
            if i in live:
                live[i].close()
            else:
                self.fleet.release(refs[i])
        return {"removed": ids, "layers_deleted": self.fleet.gc()}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            try:
                reply = {"ok": True, "result": self.server.handle_op(json.loads(line))}
            except Exception as err:  # noqa: BLE001 -- every failure goes back to the client, named
                reply = {"ok": False, "error": type(err).__name__, "message": str(err)}
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()


def serve(fleet: Fleet, path: str, stop: threading.Event) -> None:
    """Serve until `stop` is set, then close the fleet (every sandbox) and remove the socket."""
    try:
        server = FleetServer(fleet, path)
    except BaseException:
        fleet.close()
        raise
    thread = threading.Thread(target=server.serve_forever, name="sandbox-server", daemon=True)
    thread.start()
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        fleet.close()


def request(path: str, op: str, timeout: float = base.CALL_DEADLINE_S, **args):
    """One call to the server at `path`; its errors come back as the same class where the client knows it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise FileNotFoundError(f"no sandbox server at {path}: start one with `k3 sandbox serve`") from None
        sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
        with sock.makefile("rb") as f:
            line = f.readline()
    if not line:
        raise ConnectionError(f"the sandbox server at {path} closed the connection")
    reply = json.loads(line)
    if reply["ok"]:
        return reply["result"]
    cls = getattr(base, reply["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, base.SandboxError)):
        cls = ValueError if reply["error"] in ("ValueError", "KeyError") else RuntimeError
    raise cls(reply["message"])


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError:
            return False
    return True
