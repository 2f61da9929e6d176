"""Buffered counter and histogram series read exactly as prometheus_client's own would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from extproc.runtime.metric_buffers import BufferedRegistry, CounterBuffer, HistogramBuffer
from extproc.runtime.metrics import PHASE_BUCKETS, Metrics


def _families(registry: CollectorRegistry) -> dict[bytes, float]:
    """Every sample but ``_created`` (each series' creation time). A histogram's ``_sum`` is
    added in another order (a batch at a time), so it may differ in its last bits: rounded."""
    out = {}
    for line in generate_latest(registry).splitlines():
        if line.startswith(b"#") or b"_created" in line:
            continue
        name, value = line.rsplit(b" ", 1)
        out[name] = round(float(value), 9) if b"_sum" in name else float(value)
    return out


def test_buffered_series_expose_what_the_library_would() -> None:
    plain, buffered = CollectorRegistry(), BufferedRegistry()
    series = []
    for reg in (plain, buffered):
        c = Counter("c", "a counter", ["k"], registry=reg)
        h = Histogram("h", "a histogram", ["k"], buckets=PHASE_BUCKETS, registry=reg)
        series.append((c, h))
    rng = random.Random(3)
    (pc, ph), (bc, bh) = series
    counters = {k: (pc.labels(k), CounterBuffer(bc.labels(k))) for k in "ab"}
    histograms = {k: (ph.labels(k), HistogramBuffer(bh.labels(k))) for k in "ab"}
    for b in (*[v[1] for v in counters.values()], *[v[1] for v in histograms.values()]):
        buffered.add(b)
    for step in range(3000):
        k = rng.choice("ab")
        amount = rng.choice([1, 1, 7, 0.25])
        counters[k][0].inc(amount)
        counters[k][1].inc(amount)
        # on the bounds exactly, between them, past the last, and zero
        v = rng.choice([0.0, *PHASE_BUCKETS, rng.uniform(0, 0.3), 2.0])
        histograms[k][0].observe(v)
        histograms[k][1].observe(v)
        if step % 997 == 0:  # read mid-way: a read flushes, and later counts add to it
            assert _families(buffered) == _families(plain)
    assert _families(buffered) == _families(plain)
    assert buffered.get_sample_value("h_count", {"k": "a"}) == plain.get_sample_value("h_count", {"k": "a"})


def test_the_runtime_metrics_count_through_the_buffers_and_forget_drops_them() -> None:
    m = Metrics()
    m.admitted("t", "gold", 120, 880)
    m.phase("request_body", 0.0003)
    m.settled("end_of_stream", "t", 100, 120, "reported")
    assert m.registry.get_sample_value("sluice_tokens_precharged_total", {"tenant": "t"}) == 120
    assert m.registry.get_sample_value("sluice_tokens_refunded_total", {"tenant": "t"}) == 20
    assert m.registry.get_sample_value("sluice_extproc_phase_seconds_bucket",
                                       {"phase": "request_body", "le": "0.0005"}) == 1
    assert b'sluice_requests_total{outcome="admitted",tenant="t"} 1.0' in m.render()
    m.child(m.endpoint_picks, "pool", "10.0.0.1:80").inc()
    m.forget(m.endpoint_picks, "pool", "10.0.0.1:80")
    assert m.registry.get_sample_value("sluice_endpoint_picks_total", {"backend": "pool", "endpoint": "10.0.0.1:80"}) \
        is None
    m.child(m.endpoint_picks, "pool", "10.0.0.1:80").inc(2)  # counted again from zero
    assert m.registry.get_sample_value("sluice_endpoint_picks_total",
                                       {"backend": "pool", "endpoint": "10.0.0.1:80"}) == 2
