"""Per-sandbox cgroups: memory, pids, CPU and freezer groups under `openk3/<backend id>/<sandbox id>`, on the cgroup v1
controllers where the host mounts them (this project's machines) or the unified v2 hierarchy where it has the
controllers; `None` mode where neither is writable (the supervisor then falls back to rlimits). The zygote creates
the groups, each sandbox's middle process moves the supervisor in (so every process of the sandbox is inside), the
supervisor reads the event counters around each exec, and the backend reads usage, freezes and removes them.

Stdlib only and no sibling imports: the zygote and supervisors load this file as a top-level module.
"""

from __future__ import annotations

import os
import time

ROOT = "openk3"
RESERVED_PIDS = 2  # the supervisor itself and one file helper count against pids.max beside the sandbox's own

# logical file -> (v1 controller, v1 file), v2 file
FILES = {
    "memory.limit": (("memory", "memory.limit_in_bytes"), "memory.max"),
    "memory.usage": (("memory", "memory.usage_in_bytes"), "memory.current"),
    "memory.events": (("memory", "memory.oom_control"), "memory.events"),  # both carry "oom_kill N"
    "pids.limit": (("pids", "pids.max"), "pids.max"),
    "pids.usage": (("pids", "pids.current"), "pids.current"),
    "pids.events": (("pids", "pids.events"), "pids.events"),  # "max N": forks refused at the limit
    "cpu.quota": (("cpu", "cpu.cfs_quota_us"), "cpu.max"),
    "freeze": (("freezer", "freezer.state"), "cgroup.freeze"),
    "frozen": (("freezer", "freezer.state"), "cgroup.events"),
}
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")


def _mounts() -> tuple[dict[str, str], str | None]:
    """(v1 controller -> mount point, the v2 mount point) from this process's mountinfo."""
    v1, v2 = {}, None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            point, (fstype, _src, opts) = left.split()[4], right.split()[:3]
            if fstype == "cgroup":
                for ctl in opts.split(","):
                    v1.setdefault(ctl, point)
            elif fstype == "cgroup2" and v2 is None:
                v2 = point
    return v1, v2


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read_counter(text: str, key: str) -> int:
    """The value of `key N` in a flat-keyed cgroup file (memory.oom_control, pids.events, memory.events)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


class Cgroups:
    """The groups of one backend. `mode` is "v1", "v2" or None (no writable cgroups: limits fall back to rlimits);
    `why` says why it is None."""

    def __init__(self, backend_id: str, enabled: bool = True):
        self.backend_id, self.mode, self.why, self.dirs = backend_id, None, "disabled", {}
        if not enabled:
            return
        v1, v2 = _mounts()
        try:
            if all(c in v1 for c in V1_CONTROLLERS):
                self.mode, self.dirs = "v1", {c: os.path.join(v1[c], ROOT, backend_id) for c in V1_CONTROLLERS}
                for d in self.dirs.values():
                    os.makedirs(d, exist_ok=True)
            elif v2 is not None:
                with open(os.path.join(v2, "cgroup.controllers")) as f:
                    missing = set(V2_CONTROLLERS) - set(f.read().split())
                if missing:
                    raise OSError(f"the cgroup v2 hierarchy at {v2} lacks the {sorted(missing)} controllers")
                self.mode, self.dirs = "v2", {"v2": os.path.join(v2, ROOT, backend_id)}
                enable = " ".join("+" + c for c in V2_CONTROLLERS)
                for d in (v2, os.path.join(v2, ROOT), self.dirs["v2"]):
                    os.makedirs(d, exist_ok=True)
                    _write(os.path.join(d, "cgroup.subtree_control"), enable)
            else:
                self.why = "no cgroup v1 memory/pids/cpu/freezer controllers and no cgroup v2 hierarchy are mounted"
        except OSError as e:
            self.mode, self.dirs, self.why = None, {}, f"cgroups are not writable here ({e})"

    def group_dirs(self, sid: str) -> list[str]:
        return [os.path.join(d, sid) for d in self.dirs.values()]

    def path(self, sid: str, what: str) -> str:
        (ctl, v1file), v2file = FILES[what]
        return (
            os.path.join(self.dirs[ctl], sid, v1file)
            if self.mode == "v1"
            else os.path.join(self.dirs["v2"], sid, v2file)
        )

    def procs(self, sid: str) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.group_dirs(sid)]

    def create(self, sid: str, memory_mb: int | None, cpus: float | None, max_pids: int | None) -> None:
        for d in self.group_dirs(sid):
            os.mkdir(d)
        if memory_mb is not None:
            _write(self.path(sid, "memory.limit"), str(memory_mb << 20))
        if max_pids is not None:
            _write(self.path(sid, "pids.limit"), str(max_pids + RESERVED_PIDS))
        if cpus is not None:
            period = 100_000
            quota = str(int(cpus * period))
            _write(self.path(sid, "cpu.quota"), quota if self.mode == "v1" else f"{quota} {period}")

    def usage(self, sid: str) -> tuple[int, int]:
        """(memory bytes, processes) the group holds now."""
        with open(self.path(sid, "memory.usage")) as f:
            memory = int(f.read())
        with open(self.path(sid, "pids.usage")) as f:
            pids = int(f.read())
        return memory, pids

    def freeze(self, sid: str, frozen: bool, deadline_s: float = 10.0) -> None:
        """Freeze (or thaw) every process of the group and wait until the kernel says it is done."""
        if self.mode == "v1":
            _write(self.path(sid, "freeze"), "FROZEN" if frozen else "THAWED")
            want = lambda text: text.strip() == ("FROZEN" if frozen else "THAWED")
        else:
            _write(self.path(sid, "freeze"), "1" if frozen else "0")
            want = lambda text: read_counter(text, "frozen") == int(frozen)
        end = time.monotonic() + deadline_s
        while True:
            with open(self.path(sid, "frozen")) as f:
                if want(f.read()):
                    return
            if time.monotonic() > end:
                raise TimeoutError(f"cgroup freezer: {sid} not {'frozen' if frozen else 'thawed'} in {deadline_s} s")
            time.sleep(0.001)

    def remove(self, sid: str, deadline_s: float = 5.0) -> None:
        """Remove the sandbox's groups once their last process is gone (a dying process leaves them EBUSY briefly)."""
        end = time.monotonic() + deadline_s
        for d in self.group_dirs(sid):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.002)

    def remove_backend(self) -> None:
        """The backend's own groups and whatever sandbox groups are left in them (their processes are gone)."""
        for d in self.dirs.values():
            remove_tree(d)


def remove_tree(d: str) -> None:
    """rmdir a cgroup folder and its child groups, bottom up (a cgroup folder's files cannot be unlinked)."""
    if not os.path.isdir(d):
        return
    for entry in os.scandir(d):
        if entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)
    try:
        os.rmdir(d)
    except OSError:
        pass  # still populated: a process of another owner lives there; the next sweep retries


def stale_backend_dirs(backend_ids_alive) -> list[str]:
    """Backend group folders under every openk3 root whose backend id is not in `backend_ids_alive`."""
    v1, v2 = _mounts()
    roots = {os.path.join(p, ROOT) for c, p in v1.items() if c in V1_CONTROLLERS}
    if v2:
        roots.add(os.path.join(v2, ROOT))
    out = []
    for r in roots:
        if os.path.isdir(r):
            out += [e.path for e in os.scandir(r) if e.is_dir() and e.name not in backend_ids_alive]
    return out
