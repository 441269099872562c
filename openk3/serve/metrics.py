"""Prometheus metrics of a serving engine (listed in docs/serving.md): latency histograms measured per request, and the
engine's own counters read at scrape time.

    openk3_time_to_first_token_seconds        histogram   arrival -> first output token
    openk3_time_per_output_token_seconds      histogram   (finish - first token) / (tokens - 1), per request
    openk3_e2e_request_latency_seconds        histogram   arrival -> finish
    openk3_requests_total{outcome}            counter     finished: stop | length | abort
    openk3_generation_tokens_total            counter
    openk3_num_requests_{waiting,running}     gauge
    openk3_cache_{blocks_used,blocks_total,slots_used,checkpoints,checkpoint_bytes}   gauge
    openk3_prefix_cache_{queries,prompt_tokens,mla_hit_tokens,state_hit_tokens}_total  counter
    openk3_prefix_cache_{mla,state}_hit_rate  gauge       hit tokens / prompt tokens queried
    openk3_spec_decode_{drafted,accepted}_tokens_total  counter;  openk3_spec_decode_acceptance_rate  gauge
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's counters when Prometheus scrapes (no duplicate bookkeeping)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        sched, manager, stats = engine.scheduler, engine.manager, engine.manager.stats
        usage = manager.usage()
        yield GaugeMetricFamily("openk3_num_requests_waiting", "Requests waiting for a slot", value=len(sched.waiting))
        yield GaugeMetricFamily("openk3_num_requests_running", "Requests holding a slot", value=len(sched.running))
        for key in ("blocks_used", "blocks_total", "slots_used", "checkpoints", "checkpoint_bytes"):
            yield GaugeMetricFamily(f"openk3_cache_{key}", f"Cache {key.replace('_', ' ')}", value=usage[key])
        for key in ("queries", "prompt_tokens", "mla_hit_tokens", "state_hit_tokens"):
            yield CounterMetricFamily(f"openk3_prefix_cache_{key}", f"Prefix cache {key}", value=getattr(stats, key))
        queried = max(stats.prompt_tokens, 1)
        yield GaugeMetricFamily("openk3_prefix_cache_mla_hit_rate", "MLA latent hit tokens / prompt tokens queried",
                                value=stats.mla_hit_tokens / queried)  # fmt: skip
        yield GaugeMetricFamily("openk3_prefix_cache_state_hit_rate", "Effective (state checkpoint) hit tokens / "
                                "prompt tokens queried", value=stats.state_hit_tokens / queried)  # fmt: skip
        spec = engine.spec_stats
        yield CounterMetricFamily("openk3_spec_decode_drafted_tokens", "Drafted tokens", value=spec.drafted)
        yield CounterMetricFamily("openk3_spec_decode_accepted_tokens", "Accepted drafted tokens", value=spec.accepted)
        yield GaugeMetricFamily("openk3_spec_decode_acceptance_rate", "Accepted / drafted", value=spec.acceptance_rate)


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("openk3_time_to_first_token_seconds", "Time to first token", registry=self.registry,
                              buckets=LATENCY_BUCKETS)  # fmt: skip
        self.tpot = Histogram("openk3_time_per_output_token_seconds", "Time per output token after the first",
                              registry=self.registry, buckets=LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram("openk3_e2e_request_latency_seconds", "Arrival to finish", registry=self.registry,
                             buckets=LATENCY_BUCKETS)  # fmt: skip
        self.requests = Counter("openk3_requests", "Finished requests", ["outcome"], registry=self.registry)
        self.tokens = Counter("openk3_generation_tokens", "Generated tokens", registry=self.registry)
        self._open: dict[str, list[float | None]] = {}  # request id -> [arrival, first token time]

    def on_arrival(self, request_id: str) -> None:
        self._open[request_id] = [time.perf_counter(), None]

    def on_output(self, out, now: float) -> None:
        times = self._open.get(out.request_id)
        if times is None:
            return
        if times[1] is None and any(o.token_ids for o in out.outputs):
            times[1] = now
            self.ttft.observe(now - times[0])
        if out.finished:
            del self._open[out.request_id]
            n = sum(len(o.token_ids) for o in out.outputs)
            self.tokens.inc(n)
            self.e2e.observe(now - times[0])
            if times[1] is not None and n > 1:
                self.tpot.observe((now - times[1]) / (n - 1))
            self.requests.labels(outcome=out.outputs[0].finish_reason or "stop").inc()

    def on_abort(self, request_id: str) -> None:
        if self._open.pop(request_id, None) is not None:
            self.requests.labels(outcome="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
