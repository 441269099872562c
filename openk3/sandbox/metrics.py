"""Prometheus metrics of a sandbox fleet (as the server's, serve/metrics.py): latency histograms observed around every
call the fleet's sandboxes make, and the fleet's gauges read at scrape time from `Fleet.stats()`.

    openk3_sandbox_op_seconds{op}             histogram  create, exec, write_file, read_file, list_dir, snapshot,
                                                         restore, fork, pause, resume, close, stats
    openk3_sandbox_op_errors_total{op,error}  counter    calls that raised, by error class
    openk3_sandbox_{live,warm,paused}         gauge      handed-out / pooled / paused sandboxes
    openk3_sandbox_{memory,disk}_bytes        gauge      sum of the sandboxes' own stats()
    openk3_sandbox_layers, openk3_sandbox_layer_bytes, openk3_sandbox_snapshots  gauge  the layer store, live refs
    openk3_sandbox_reclaimed_total            counter    idle sandboxes the fleet closed
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Sandbox calls run from about 1 ms (exec of `true`) to a minute (an exec's own timeout).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OPS = ("create", "exec", "write_file", "read_file", "list_dir", "snapshot", "restore", "fork", "pause", "resume",
       "close", "stats")  # fmt: skip
GAUGES = {
    "live": "Sandboxes handed out and not closed",
    "warm": "Sandboxes started and waiting in the warm pool",
    "paused": "Handed-out sandboxes that are paused",
    "memory_bytes": "Memory the sandboxes use (sum of their stats())",
    "disk_bytes": "Disk the sandboxes' writable layers use (sum of their stats())",
    "layers": "Snapshot layers in the layer store",
    "layer_bytes": "Bytes of the snapshot layers in the layer store",
    "snapshots": "Snapshot refs the fleet holds (taken and not released)",
}


class _FleetCollector:
    """Reads `stats()` when Prometheus scrapes (one source of truth for the numbers)."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for key, doc in GAUGES.items():
            yield GaugeMetricFamily(f"openk3_sandbox_{key}", doc, value=stats[key])
        yield CounterMetricFamily("openk3_sandbox_reclaimed", "Idle sandboxes closed by the fleet",
                                  value=stats["reclaimed"])  # fmt: skip


class FleetMetrics:
    """One registry per fleet (several fleets in one process do not share counters)."""

    def __init__(self, stats):
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(stats))
        self.latency = Histogram("openk3_sandbox_op_seconds", "Latency of sandbox operations", ["op"],
                                 registry=self.registry, buckets=LATENCY_BUCKETS)  # fmt: skip
        self.errors = Counter("openk3_sandbox_op_errors", "Sandbox operations that raised", ["op", "error"],
                              registry=self.registry)  # fmt: skip
        for op in OPS:  # every histogram is exported from the start, zero until used
            self.latency.labels(op=op)

    @contextmanager
    def timed(self, op: str):
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as err:
            self.errors.labels(op=op, error=type(err).__name__).inc()
            raise
        finally:
            self.latency.labels(op=op).observe(time.perf_counter() - t0)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
