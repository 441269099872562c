"""How many CPU threads a `k3` command uses, and how its threads wait: the rule, in one place.

1. **Count.** An explicit `--threads N` wins; then `OMP_NUM_THREADS` when set; otherwise the physical cores this
   process may run on that are *free* when the command starts, shared among the processes the command launches on
   this machine (`--nproc`). "Free" subtracts what other processes keep busy, sampled over a short window
   (`busy_cores_of_others`), so a second job started beside a first one takes the cores the first leaves, not all
   of them. Never fewer than one.
2. **Waiting.** OpenMP threads that finish a parallel region early spin on their core for a while (libgomp's
   default: 300,000 turns, then sleep), for ever (`OMP_WAIT_POLICY=ACTIVE`), or sleep at once (`PASSIVE`).
   Spinning long loses badly on a shared machine: a spinning thread takes the core a thread of the other job
   needed, so every barrier waits for a descheduled thread (measured: a tiny training step 12.6x slower at 3.5-4.5x
   oversubscription). Sleeping at once costs an idle machine a wake-up at every barrier (measured on 2 cores: tiny
   training 1.2x slower with `PASSIVE` than with libgomp's default, while 10,000 turns matched the default). So
   openk3 sets `GOMP_SPINCOUNT=10000` (a short spin, then sleep) unless the user set a policy (`OMP_WAIT_POLICY` or
   `GOMP_SPINCOUNT`); libgomp reads it once, when torch loads it, so this runs when `openk3` is imported (before
   torch) and has no effect where torch was imported first.

The count is chosen once, at start, and a run never changes it: results may depend on the thread count (a matmul's
reduction order), so a run that must be reproducible across machines or loads names `--threads`.
Only the standard library is imported at module level: `openk3/__init__.py` imports this before torch.
"""

from __future__ import annotations

import os
import time

# Turns a waiting OpenMP thread spins before it sleeps (libgomp's default is 300,000).
SPIN_COUNT_DEFAULT = "10000"
# How long `busy_cores_of_others` watches the machine: long enough to see a running job (scheduler ticks are 4 ms
# or less), short enough not to be noticed at start.
SAMPLE_S = 0.25


def default_omp_wait_policy() -> None:
    """Rule 2: `GOMP_SPINCOUNT=10000` unless the user set a policy (`OMP_WAIT_POLICY`, or `GOMP_SPINCOUNT`, e.g.
    300000 for libgomp's own default). Inherited by every process a command starts."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT_DEFAULT


def _allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (`os.sched_getaffinity`: a container's or `taskset`'s
    limit, not the machine's count); hyperthread siblings count once. Falls back to the CPU count where the
    topology is not readable."""
    cores = set()
    for cpu in _allowed_cpus():
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def _busy_ticks(cpus: list[int]) -> int | None:
    """Non-idle jiffies of `cpus` since boot (/proc/stat), or None where it is not readable."""
    try:
        with open("/proc/stat") as f:
            rows = {r.split()[0]: r.split()[1:] for r in f if r.startswith("cpu") and not r.startswith("cpu ")}
    except OSError:
        return None
    busy = 0
    for cpu in cpus:
        fields = rows.get(f"cpu{cpu}")
        if fields is None or len(fields) < 5:
            return None
        # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user/nice]
        values = [int(v) for v in fields[:8]]
        busy += sum(values) - values[3] - values[4]
    return busy


def busy_cores_of_others(sample_s: float = SAMPLE_S) -> float:
    """Cores' worth of CPU time the *other* processes used on this process's CPUs over the last `sample_s` seconds:
    (busy jiffies of the allowed CPUs - this process's own CPU time) / elapsed. 0.0 where /proc is not readable (then
    the rule is "all the cores", as before). Hyperthreads count as cores here; `pick_threads` scales to physical."""
    cpus = _allowed_cpus()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    start, own_start, t0 = _busy_ticks(cpus), time.process_time(), time.monotonic()
    if start is None:
        return 0.0
    time.sleep(sample_s)
    end, own_end, t1 = _busy_ticks(cpus), time.process_time(), time.monotonic()
    if end is None or t1 <= t0:
        return 0.0
    others = (end - start) / tick - (own_end - own_start)
    return max(0.0, others / (t1 - t0))


def pick_threads(threads: int | None = None, local_world_size: int = 1) -> tuple[int, str]:
    """(torch CPU threads for this process, why that many): rule 1 above. More threads than free cores is what made
    a loaded machine 20-100x slower: a parallel matmul waits for its slowest thread, and an oversubscribed core runs
    them in turns."""
    cores = physical_cores()
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"--threads must be positive, got {threads}")
        return threads, f"--threads; {cores} cores available"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env}; {cores} cores available"
    logical = max(1, len(_allowed_cpus()))
    busy = busy_cores_of_others() * cores / logical  # logical CPUs' time -> physical cores
    free = max(1, min(cores, round(cores - busy)))
    why = f"of {cores} cores" if free == cores else f"{free} of {cores} cores free"
    if local_world_size > 1:
        return max(1, free // local_world_size), f"{why} / {local_world_size} processes"
    return free, why


def set_threads(threads: int | None = None, local_world_size: int = 1) -> str:
    """`torch.set_num_threads` with `pick_threads`'s count; returns the line every command's header shows, e.g.
    `threads: 2 (of 2 cores; --threads to change)`."""
    import torch

    n, why = pick_threads(threads, local_world_size)
    torch.set_num_threads(n)
    return f"threads: {n} ({why})" if threads is not None else f"threads: {n} ({why}; --threads to change)"
