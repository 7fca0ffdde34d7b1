"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own.

Names and labels follow vLLM's under our prefix, `hybridserve:` for `vllm:`, so its dashboards
and alerts work with that one substitution; every series carries `model_name` (the first
served name), and no `_created` series are exported. The mapping (vLLM name -> ours):

    vllm:num_requests_running / _waiting   hybridserve:num_requests_running / _waiting
    vllm:kv_cache_usage_perc               hybridserve:kv_cache_usage_perc (0-1)
    vllm:prefix_cache_queries / _hits      hybridserve:prefix_cache_queries / _hits (tokens)
    vllm:num_preemptions                   hybridserve:num_preemptions
    vllm:prompt_tokens / generation_tokens hybridserve:prompt_tokens / generation_tokens
    vllm:request_success{finished_reason}  hybridserve:request_success{finished_reason}
    vllm:time_to_first_token_seconds       hybridserve:time_to_first_token_seconds
    vllm:inter_token_latency_seconds       hybridserve:inter_token_latency_seconds
    vllm:e2e_request_latency_seconds       hybridserve:e2e_request_latency_seconds

(counters end in `_total` in the exposition, as vLLM's do). Ours beside them: HTTP requests by
endpoint and status, the queue, cache pages, the prefix-cache hit rate, packed-prefill slots
and P/D transfer figures. Tokens/s is `rate(hybridserve:generation_tokens_total[1m])`.

Read from the engine's latest statistics at scrape time (`AsyncEngine.stats()`): queue depth,
running and waiting requests, cache usage and pages, prefix-cache hit rate and tokens,
preemptions, prompt tokens computed and their padded slots (packed prefill) and, on a P/D
instance, KV transfer bytes, failures, GB/s and held requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridserve.outputs import RequestOutput

disable_created_metrics()  # no `_created` series (process-wide in prometheus_client)
PREFIX = "hybridserve:"
log = logging.getLogger("hybridserve.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# (engine stats key, metric name, help); gauges, then counters (monotonic engine totals)
_GAUGES = (
    ("queue_depth", "queue_depth", "Requests admitted and not finished (bounded by max_queue)"),
    ("max_queue", "max_queue", "Most requests admitted at once (--max-queue)"),
    ("num_running", "num_requests_running", "Requests running in the engine"),
    ("num_waiting", "num_requests_waiting", "Requests waiting in the engine"),
    ("cache_usage", "kv_cache_usage_perc", "Fraction of cache pages in use (0-1)"),
    ("num_pages_used", "cache_pages_used", "Cache pages referenced by requests"),
    ("num_pages_total", "cache_pages_total", "Usable cache pages"),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens served from the cache"),
    ("held_requests", "kv_transfer_held_requests", "Prefill requests holding pages for decode"),
    ("transfer_gbps", "kv_transfer_gbps", "KV transfer rate over the last 10 s (GB/s)"),
)
_COUNTERS = (
    ("prefix_cache_queried_tokens", "prefix_cache_queries", "Prompt tokens looked up"),
    ("prefix_cache_hit_tokens", "prefix_cache_hits", "Prompt tokens found in the cache"),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of pages"),
    ("prefill_tokens", "prefill_tokens", "Prompt tokens computed by prefill programs"),
    ("prefill_tokens_padded", "prefill_tokens_padded", "Their program slots, padding included"),
    ("transfer_bytes", "kv_transfer_bytes", "KV cache and state bytes transferred"),
    ("transfer_failures", "kv_transfer_failures", "KV transfers that failed"),
)


class _EngineCollector:
    """Turns the latest engine statistics into metric families at each scrape."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], alive: Callable[[], bool], model: str
    ) -> None:
        self._stats = stats
        self._alive = alive
        self._model = model

    def _family(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, name, doc in _GAUGES:
            if key in stats:
                yield self._family(GaugeMetricFamily, name, doc, float(stats[key]))
        for key, name, doc in _COUNTERS:
            if key in stats:
                yield self._family(CounterMetricFamily, name, doc, float(stats[key]))
        alive = float(self._alive())
        yield self._family(GaugeMetricFamily, "engine_alive", "1 while the engine loop runs", alive)


class ServerMetrics:
    """The server's metrics (see the module docstring)."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        alive: Callable[[], bool],
        model: str = "default",
    ) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests by endpoint and response status",
            [*m, "endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Generation requests by finish reason (stop, length, abort, timeout, error)",
            [*m, "finished_reason"],
            registry=r,
        )
        hist = [
            ("time_to_first_token_seconds", "Arrival to first generated token", _LATENCY),
            ("inter_token_latency_seconds", "Time between generated tokens", _TOKEN_GAP),
            ("e2e_request_latency_seconds", "Arrival to the end of the request", _LATENCY),
        ]
        self.ttft, self.itl, self.e2e = (
            Histogram(PREFIX + name, doc, m, buckets=b, registry=r).labels(model)
            for name, doc, b in hist
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", m, registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens", m, registry=r
        ).labels(model)
        self.model = model
        r.register(_EngineCollector(stats, alive, model))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: counts every HTTP request by endpoint (unknown paths: "other") and
    response status: 500 when the app fails before responding, but 499 when the client had
    disconnected by then (a body cut off while being read is the client's doing, not an error
    of the server)."""

    def __init__(self, app: Any, metrics: ServerMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        left = False

        async def receive_and_note() -> dict:
            nonlocal left
            message = await receive()
            if message["type"] == "http.disconnect":
                left = True
            return message

        async def send_and_note(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive_and_note, send_and_note)
        finally:
            if status is None:
                status = 499 if left else 500
            path = scope.get("path", "")
            endpoint = path if path in self.endpoints else "other"
            self.metrics.http_requests.labels(self.metrics.model, endpoint, str(status)).inc()


class RequestTrack:
    """One request's metrics (TTFT, inter-token gaps, tokens, its finish reason and end to
    end latency) and its log line."""

    def __init__(self, metrics: ServerMetrics, req_id: str, arrival: float) -> None:
        self.metrics = metrics
        self.req_id = req_id
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival
        self.tokens = 0
        self.prompt_tokens = 0
        self.reason: str | None = None
        self.closed = False

    def observe(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe((now - self.last) / n)
            self.last = now
            self.tokens += n
            self.metrics.generation_tokens.inc(n)
        if out.finished:
            self.reason = out.outputs[0].finish_reason

    def done(self, reason: str = "abort") -> None:
        if self.closed:
            return
        self.closed = True
        reason = self.reason or reason
        now = time.perf_counter()
        self.metrics.finished.labels(self.metrics.model, reason).inc()
        self.metrics.e2e.observe(now - self.arrival)
        ttft = "-" if self.first is None else f"{1000 * (self.first - self.arrival):.1f}ms"
        log.info(
            "%s prompt_tokens=%d completion_tokens=%d finish=%s ttft=%s e2e=%.1fms",
            self.req_id,
            self.prompt_tokens,
            self.tokens,
            reason,
            ttft,
            1000 * (now - self.arrival),
        )


def proxy_metrics(counters: dict[str, int], health: dict[str, dict[str, bool]]) -> bytes:
    """The proxy's `/metrics`: its counters (`ProxyStats`) as `hybridserve:proxy_<name>_total`
    and each instance's rotation state as `hybridserve:proxy_instance_healthy{role, url}`."""
    registry = CollectorRegistry()

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            for name, value in counters.items():
                doc = f"Proxy {name.replace('_', ' ')}"
                yield CounterMetricFamily(f"{PREFIX}proxy_{name}", doc, value=float(value))
            family = GaugeMetricFamily(
                f"{PREFIX}proxy_instance_healthy", "1 while the instance is in rotation",
                labels=["role", "url"],
            )  # fmt: skip
            for role, instances in health.items():
                for url, ok in instances.items():
                    family.add_metric([role, url], float(ok))
            yield family

    registry.register(_Collector())
    return generate_latest(registry)
