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

The three latency histograms are observed once per streamed token (inter-token latency), on
the event loop: LoopHistogram keeps them as plain counters (no lock, one bisect) and renders
them at scrape time exactly as prometheus_client's Histogram would.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

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


class LoopHistogram:
    """A one-label histogram written from one thread (the event loop) without a lock: observe()
    is a bisect and two additions. A scrape (any thread) copies the counts, so it sees every
    observation either entirely or not at all except for the sum, which may run one ahead."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)     # the last one: +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        counts, total = list(self.counts), self.sum
        buckets, acc = [], 0
        for bound, n in zip(self.bounds + [float("inf")], counts):
            acc += n
            buckets.append((floatToGoString(bound), float(acc)))
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], buckets, total)
        family.add_sample(self.name + "_created", {"model_name": self.model_name}, self.created)
        yield family


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = LoopHistogram("moet:time_to_first_token_seconds", "time from arrival to the first generated token",
                                  model_name, _LATENCY_BUCKETS)
        self.itl = LoopHistogram("moet:inter_token_latency_seconds", "time between consecutive generated tokens",
                                 model_name, _ITL_BUCKETS)
        self.e2e = LoopHistogram("moet:e2e_request_latency_seconds", "time from arrival to the last token",
                                 model_name, _LATENCY_BUCKETS)
        for h in (self.ttft, self.itl, self.e2e):
            r.register(h)
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
        if new_tokens:
            each, itl = since_last / new_tokens, self.itl
            for _ in range(new_tokens):
                itl.observe(each)

    def finished(self, reason: str | None, e2e_s: float) -> None:
        self.request_success.labels(self.model_name, reason or "abort").inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
