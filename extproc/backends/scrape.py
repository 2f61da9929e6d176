"""Reading a backend's Prometheus endpoint: KV-cache usage, queue, preemptions.

``parse_sample`` and ``classify_answer`` are pure; ``scrape_once`` does the HTTP.
Which metrics to read is policy (:mod:`extproc.policy.engine_metrics`: a preset per
engine, selectors with label matchers, tried in order; the first selector that
matches a series wins, so a deprecated name can follow its replacement).

A scrape ends in one of four states, and each means something different for admission
(:func:`kv_source`):

* ``ok``: the exposition was read; ``kv_usage`` is set unless the engine has no KV
  metric (llama.cpp, TGI), in which case the KV signal is Sluice's own reservations.
* ``no_series``: reachable, valid exposition, but the KV gauge has no series yet
  (SGLang and TRT-LLM create gauges at the first batch): idle-but-unknown, so the
  reservations decide, not "saturated".
* ``problem``: reachable but unusable, and it will not fix itself: JSON instead of
  Prometheus text (trtllm-serve's ``/metrics``), 404/501, or an eager engine without
  any of its metrics (vLLM ``--disable-log-stats``). Reported loudly (``problem``
  names it, ``hint`` says what to fix); the reservations decide meanwhile.
* ``unreachable``: connection error, timeout, another HTTP status, an unparseable
  exposition: saturated, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.policy.engine_metrics import PRESETS, EngineMetrics, Selector, engine_metrics

__all__ = ["PRESETS", "Sample", "classify_answer", "engine_metrics", "kv_fraction", "kv_source", "parse_sample",
           "reserved_fraction", "scrape_once", "scrape_status"]

# Statuses that mean "the URL or the engine's setup is wrong", not "the engine is busy".
_PROBLEM_STATUSES = (404, 501)
# Above 1 a fraction is rounding noise (1.0000001); only values clearly in percent are divided.
PERCENT_ABOVE = 1.5


@dataclass(frozen=True)
class Sample:
    ok: bool  # the exposition was read (state ok or no_series)
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    preemptions: float | None = None
    error: str = ""
    state: str = "ok"  # ok | no_series | problem | unreachable
    problem: str = ""  # when state == problem: not_prometheus, http_404, no_engine_metrics, ...
    hint: str = ""  # what to fix, for the log line and the console
    kv_series: int = 0  # how many series (engines, ranks) the KV value combines


def kv_fraction(value: float, unit: str) -> float:
    """A KV reading as a fraction in [0, 1].

    ``fraction``: clamped (1.0000001 is full, not 1 %). ``auto``: above
    :data:`PERCENT_ABOVE` the exporter reports percent; at or below it a fraction.
    """
    if unit == "percent" or (unit == "auto" and value > PERCENT_ABOVE):
        value = value / 100.0
    return min(max(value, 0.0), 1.0)


def kv_source(sample: Sample | None, kv_bound: bool = True) -> str:
    """Where the KV signal comes from: ``engine``, ``reservations`` or ``saturated``.

    ``reservations``: the engine says nothing about its cache (no KV metric, no series
    yet, or a setup problem); Sluice's own reservations against ``kv_capacity_tokens``
    bound admission and the engine queue alone drives the watermark.

    ``kv_bound``: whether ``kv_capacity_tokens`` is set. A ``problem`` scrape without it
    has nothing at all bounding the cache (no KV, no queue, no reservation limit), so it
    counts as saturated, like an unreachable one, until the metrics are fixed.
    """
    if sample is None or sample.state == "unreachable":
        return "saturated"
    if sample.state == "problem" and not kv_bound:
        return "saturated"
    if sample.state == "ok" and sample.kv_usage is not None:
        return "engine"
    return "reservations"


def reserved_fraction(reserved: int, capacity: int | None) -> float | None:
    """Sluice's own KV reservations as a fraction of the cache (above 1 when overcommitted)."""
    return None if capacity is None else reserved / capacity


def scrape_status(sample: object | None, reserved: int, capacity: int | None, has_metrics: bool) -> dict[str, Any]:
    """The status-report view of the last scrape: the KV value shown, where it comes from,
    the scrape's state and, when the metrics cannot be used, the problem and its fix."""
    s = sample if isinstance(sample, Sample) else None
    source = kv_source(s, capacity is not None) if has_metrics else "none"
    kv = s.kv_usage if s is not None and source == "engine" else None
    if source == "reservations":
        kv = reserved_fraction(reserved, capacity)
    return {"kv_usage": kv, "kv_source": source, "metrics_state": s.state if s is not None else None,
            "metrics_problem": {"problem": s.problem, "error": s.error, "hint": s.hint}
            if s is not None and s.state == "problem" else None}


def _problem(metrics: EngineMetrics, code: str, error: str) -> Sample:
    return Sample(ok=False, state="problem", problem=code, hint=metrics.hint(code), error=error)


def classify_answer(status: int, content_type: str, text: str, metrics: EngineMetrics) -> Sample | None:
    """A Sample for an answer that cannot be read as an exposition, else None."""
    if status in _PROBLEM_STATUSES:
        return _problem(metrics, f"http_{status}", f"HTTP {status}")
    if status != 200:
        return Sample(ok=False, state="unreachable", error=f"HTTP {status}")
    head = text.lstrip()[:1]
    if "json" in content_type.lower() or head in ("{", "["):
        return _problem(metrics, "not_prometheus", f"JSON answer ({content_type or 'no content type'})")
    if "html" in content_type.lower() or head == "<":
        return _problem(metrics, "not_prometheus", f"HTML answer ({content_type or 'no content type'})")
    return None


def parse_sample(text: str, metrics: EngineMetrics) -> Sample:
    """Read one exposition. Series from several engines or ranks combine: the fullest KV
    cache binds (max), queue lengths and preemption counters add up (sum)."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    engine_seen = False
    try:
        for family in text_string_to_metric_families(text):
            # A family announced by HELP/TYPE counts as the engine's even without samples.
            engine_seen = engine_seen or bool(metrics.prefix and family.name.startswith(metrics.prefix))
            for s in family.samples:
                by_name.setdefault(s.name, []).append((s.labels, float(s.value)))
    except (ValueError, IndexError, TypeError) as exc:
        return _problem(metrics, "not_prometheus", f"unparseable metrics: {exc}")
    engine_seen = engine_seen or any(n.startswith(metrics.prefix) for n in by_name)

    def values(selectors: tuple[Selector, ...]) -> list[float]:
        for sel in selectors:
            vs = [v for labels, v in by_name.get(sel.name, ()) if sel.matches(sel.name, labels) and not math.isnan(v)]
            if vs:
                return vs
        return []

    def total(kind: str) -> float | None:
        vs = values(metrics.of(kind))
        return sum(vs) if vs else None

    kvs = values(metrics.kv_usage)
    kv = kv_fraction(max(kvs), metrics.kv_unit) if kvs else None
    waiting, running, preemptions = total("waiting"), total("running"), total("preemptions")
    if preemptions is None and metrics.preemptions:
        # A counter appears at its first increment (SGLang's retractions): absent is 0, so the
        # first preemptions after start count instead of becoming the breaker's baseline.
        preemptions = 0.0
    if kv is not None or not metrics.kv_usage:
        return Sample(ok=True, kv_usage=kv, waiting=waiting, running=running, preemptions=preemptions,
                      kv_series=len(kvs))
    # The KV metric is absent. An eager engine has its gauges from start-up, so absence is
    # a setup problem; a lazy engine has not run a batch yet.
    if metrics.eager and not engine_seen:
        return _problem(metrics, "no_engine_metrics", f"no {metrics.prefix} metric in the exposition")
    if metrics.eager:
        names = ", ".join(str(s) for s in metrics.kv_usage)
        return _problem(metrics, "kv_metric_missing", f"none of {names} in the exposition")
    return Sample(ok=True, state="no_series", waiting=waiting, running=running, preemptions=preemptions,
                  error="no KV series yet")


async def scrape_once(session: aiohttp.ClientSession, url: str, metrics: EngineMetrics,
                      timeout_s: float = 1.0) -> Sample:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text() if r.status in (200, *_PROBLEM_STATUSES) else ""
            bad = classify_answer(r.status, r.headers.get("Content-Type", ""), text, metrics)
    except UnicodeDecodeError as exc:  # reachable, but not text
        return _problem(metrics, "not_prometheus", f"undecodable answer: {exc}")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return Sample(ok=False, state="unreachable", error=f"{type(exc).__name__}: {exc}")
    return bad if bad is not None else parse_sample(text, metrics)
