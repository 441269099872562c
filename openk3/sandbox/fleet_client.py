"""The `k3 sandbox` commands as functions: `serve_fleet` runs the fleet server in the foreground (fleet_server.py);
the others are one request each to it. Each prints what the command prints and returns the command's exit code;
errors are raised (SandboxError, ConnectionError, FileNotFoundError when no server listens, ValueError)."""

from __future__ import annotations

import json
import signal
import sys
import threading

from openk3.sandbox.fleet import Fleet
from openk3.sandbox.fleet_server import request, serve


def serve_fleet(socket: str, max_sandboxes: int = 64, warm: int = 4, idle_timeout_s: float = 300.0,
                image: str | None = None, **limits) -> int:  # fmt: skip
    """Run a fleet behind `socket` until SIGINT or SIGTERM, which close every sandbox. `limits`: memory_mb, cpus,
    max_pids, disk_mb (each sandbox's)."""
    fleet = Fleet(max_sandboxes=max_sandboxes, base_image=image, warm=warm, idle_timeout_s=idle_timeout_s, **limits)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"k3 sandbox serve: listening on {socket} (max {max_sandboxes} sandboxes, {warm} warm, "
          f"idle ones closed after {idle_timeout_s:g} s); Ctrl-C closes every sandbox", file=sys.stderr)  # fmt: skip
    serve(fleet, socket, stop)
    return 0


def create(socket: str) -> int:
    print(request(socket, "create")["id"])
    return 0


def exec_command(socket: str, sandbox_id: str, cmd: list[str], timeout: float = 30.0, stdin: str | None = None) -> int:
    """Run argv `cmd` (a leading "--" is dropped) in the sandbox: its stdout and stderr, and its exit code as ours."""
    cmd = cmd[1:] if cmd[:1] == ["--"] else cmd
    if not cmd:
        raise ValueError("k3 sandbox exec: no command (k3 sandbox exec ID -- CMD [ARG ...])")
    r = request(socket, "exec", timeout=timeout + 60, id=sandbox_id, cmd=cmd, stdin=stdin)
    sys.stdout.write(r["stdout"])
    sys.stderr.write(r["stderr"])
    if r["timed_out"] or r["limit"] or r["truncated"]:
        print(f"k3 sandbox exec: exit {r['exit_code']}, limit hit: {r['limit']}, output truncated: {r['truncated']}",
              file=sys.stderr)  # fmt: skip
    return r["exit_code"]


def snapshot(socket: str, sandbox_id: str, stop_processes: bool = False) -> int:
    print(request(socket, "snapshot", id=sandbox_id, stop=stop_processes)["id"])
    return 0


def restore(socket: str, sandbox_id: str, snapshot_id: str) -> int:
    request(socket, "restore", id=sandbox_id, snapshot=snapshot_id)
    return 0


def fork(socket: str, source: str, n: int = 1) -> int:
    print("\n".join(request(socket, "fork", source=source, n=n)["ids"]))
    return 0


def ls(socket: str, as_json: bool = False, metrics: bool = False) -> int:
    """The live sandboxes, the snapshots held and the fleet's totals (a table, or JSON), or the Prometheus metrics."""
    if metrics:
        sys.stdout.write(request(socket, "metrics"))
        return 0
    listing = request(socket, "ls")
    if as_json:
        print(json.dumps(listing, indent=1))
        return 0
    print(f"{'SANDBOX':24} {'STATE':8} {'IDLE s':>7} {'LAYERS':>6} {'MEMORY MiB':>10} {'DISK MiB':>9} {'PIDS':>5}")
    for r in listing["sandboxes"]:
        print(f"{r['id']:24} {r['state']:8} {r['idle_s']:>7} {r['layers']:>6} {r['memory_bytes'] / 2**20:>10.1f} "
              f"{r['disk_bytes'] / 2**20:>9.1f} {r['pids']:>5}")  # fmt: skip
    for ref in listing["snapshots"]:
        print(f"snapshot {ref['id']} ({len(ref['layers'])} layers, node {ref['node']})")
    s = listing["stats"]
    print(f"{s['live']} live ({s['paused']} paused), {s['warm']} warm of {s['max_sandboxes']}; {s['layers']} layers, "
          f"{s['layer_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    return 0


def rm(socket: str, ids: list[str]) -> int:
    """Close sandboxes and release snapshots by id, then delete the layers nothing uses."""
    r = request(socket, "rm", ids=ids)
    print(f"removed {' '.join(r['removed'])}; deleted {len(r['layers_deleted'])} unused layers")
    return 0
