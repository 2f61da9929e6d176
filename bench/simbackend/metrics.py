"""vLLM's metric names, read from the engine at scrape time (one registry per app).

A custom collector instead of Gauge/Counter objects: the engine already holds the
numbers, and families built per scrape expose counters as ``<name>_total`` without the
``_created`` series, exactly the names vLLM dashboards and the gateway's scraper expect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimCollector(Collector):
    def __init__(
        self, engine: Engine, model: str, usage_override: Callable[[], float | None]
    ) -> None:
        self.engine = engine
        self.model = model
        self.usage_override = usage_override

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model], value)
        return c

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        override = self.usage_override()
        usage = e.kv_usage if override is None else override
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield self._gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (deprecated name).", usage
        )
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(e.running),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(e.waiting),
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", e.preemptions_total
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            e.generation_tokens_total,
        )
        # vLLM V1's names and units: tokens queried and tokens found cached, per admission.
        cache = e.prefix
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            cache.queries if cache is not None else 0,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            cache.hits if cache is not None else 0,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(e.finished_total.items()):
            success.add_metric([self.model, reason], count)
        yield success
        yield self._counter(
            "sim:oom_failures",
            "Requests failed by a simulated out-of-memory.",
            e.oom_failures_total,
        )
        yield self._gauge(
            "sim:kv_blocks_total", "KV blocks in the simulated cache.", e.total_blocks
        )
        yield self._gauge("sim:kv_blocks_used", "KV blocks held by sequences.", e.used_blocks)


def make_registry(collector: SimCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def engine_report(e: Engine, steps: int, now: float) -> dict[str, Any]:
    """What GET /admin/engine returns: the engine's state and totals, for tests and benches."""
    return {
        "kv_blocks_total": e.total_blocks,
        "kv_blocks_used": e.used_blocks,
        "kv_usage": e.kv_usage,
        "running": len(e.running),
        "waiting": len(e.waiting),
        "preemptions_total": e.preemptions_total,
        "prompt_tokens_total": e.prompt_tokens_total,
        "generation_tokens_total": e.generation_tokens_total,
        "finished_total": dict(e.finished_total),
        "kv_blocks_peak": e.peak_used_blocks,
        "oom_failures_total": e.oom_failures_total,
        "paused": e.paused(now),
        "mode": e.mode,
        "scheduling_policy": e.waiting.policy,
        "aborted": e.finished_total["abort"],
        "steps": steps,
        "prefix_cache": None if e.prefix is None else {
            "queries_tokens": e.prefix.queries, "hits_tokens": e.prefix.hits,
            "shared_blocks": len(e.prefix.refs), "evictable_blocks": len(e.prefix.evictable),
            "evictions": e.prefix.evictions,
        },
    }
