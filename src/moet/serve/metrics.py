"""Prometheus metrics for GET /metrics (prometheus-client), named like vLLM's with a `moet:`
prefix so existing dashboards need only the prefix changed.

Two sources:
  - the server measures latencies per request: time to first token, inter-token latency,
    end-to-end latency (histograms), and counts requests by finish reason and HTTP status;
  - the engine's `stats()` is read at scrape time (a custom collector, so the numbers are never
    stale): requests running / waiting, KV-cache usage, prefix-cache hit rate, preemptions,
    prompt / generation token totals, and every entry of `stats().extra` (residency and
    quantization counters) as a gauge `moet:<key>`.
Each app has its own registry, so several servers (tests) can live in one process.
"""
from __future__ import annotations

import dataclasses
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

# EngineStats field -> (metric name, kind, help)
_ENGINE_FIELDS = {
    "num_running": ("moet:num_requests_running", "gauge", "requests in the running batch"),
    "num_waiting": ("moet:num_requests_waiting", "gauge", "requests waiting to be scheduled"),
    "kv_usage": ("moet:kv_cache_usage_perc", "gauge", "fraction of KV-cache blocks in use (0..1)"),
    "prefix_cache_hit_rate": ("moet:prefix_cache_hit_rate", "gauge", "prefix-cache hit rate (0..1)"),
    "num_preemptions": ("moet:num_preemptions", "counter", "requests preempted since start"),
    "prompt_tokens_total": ("moet:prompt_tokens", "counter", "prompt tokens processed since start"),
    "generation_tokens_total": ("moet:generation_tokens", "counter", "tokens generated since start"),
}


def _metric_name(key: str) -> str:
    return "moet:" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class EngineStatsCollector:
    """Reads engine.stats() when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a failing engine must not take /metrics down with it
            return
        values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)} \
            if dataclasses.is_dataclass(stats) else dict(vars(stats))
        extra = values.pop("extra", None) or {}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, kind, doc = _ENGINE_FIELDS.get(key, (_metric_name(key), "gauge", f"engine stats field {key}"))
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
        for key, value in sorted(extra.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(_metric_name(key), f"engine counter {key} (stats().extra)", labels=["model_name"])
                g.add_metric([self.model_name], float(value))
                yield g


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("moet:time_to_first_token_seconds", "time from arrival to the first generated token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("moet:inter_token_latency_seconds", "time between consecutive generated tokens",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("moet:e2e_request_latency_seconds", "time from arrival to the last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_success = Counter("moet:request_success", "finished requests by finish reason",
                                       labels + ["finished_reason"], registry=r)
        self.http_requests = Counter("moet:http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.rejected = Counter("moet:requests_rejected", "requests refused before running (queue full, timeout)",
                                ["reason"], registry=r)
        self.in_flight = Gauge("moet:server_requests_in_flight", "requests the HTTP server is serving", registry=r)
        r.register(EngineStatsCollector(engine, model_name))

    def observe_tokens(self, first: bool, since_arrival: float, since_last: float, new_tokens: int) -> None:
        """One engine step's output for one request: `new_tokens` arrived `since_last` after the
        previous ones (TTFT on the first step; the step time is spread over its tokens after)."""
        if new_tokens <= 0:
            return
        if first:
            self.ttft.observe(since_arrival)
            new_tokens -= 1
        for _ in range(new_tokens):
            self.itl.observe(since_last / max(new_tokens, 1))

    def finished(self, reason: str | None, e2e_s: float) -> None:
        self.request_success.labels(self.model_name, reason or "abort").inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
