"""A scrape result turned into admission state: engine KV, reservations, saturated, and
problems said loudly (metric, one log line, the status the console shows)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.procs import free_port
from extproc.backends.hold import Hold
from extproc.backends.scrape import Sample, classify_answer, parse_sample
from extproc.backends.state import BackendState
from extproc.policy.reader import PolicyError
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.metrics import Metrics
from extproc.runtime.runtime import Runtime
from extproc.service.monitor import apply_sample, metric_names, report_change, run_monitor
from tests.backend_ops import try_acquire
from tests.waiting import eventually_async

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
URL = "http://127.0.0.1:1/metrics"


def policy(engine: str = "vllm", url: str = URL, **extra: Any) -> Any:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8, "kv_capacity_tokens": 1000,
                      "kv_block_size": 10, "metrics_url": url, "engine": engine, **extra,
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"hi": {"tpm": 100000, "rpm": 100}},
        "tenants": [{"name": "a", "tier": "hi", "keys": [hash_key("a")]}],
    })


def backend(engine: str = "vllm", **extra: Any) -> BackendState:
    p = policy(engine, **extra)
    return BackendState.create(p.backends[0], p, 0.0)


def feed(m: Metrics, be: BackendState, s: Sample, now: float) -> None:
    previous, be.sample = be.sample, s
    apply_sample(m, "b", be, s, now)
    report_change(m, "b", URL, previous, s)


def problem_gauge(m: Metrics, problem: str) -> float | None:
    return m.registry.get_sample_value("sluice_backend_metrics_problem", {"backend": "b", "problem": problem})


def test_no_series_yet_admits_by_reservations_not_as_saturated() -> None:
    m, be = Metrics(), backend("sglang")
    floor = be.spec.watermark.floor
    assert be.scale(0.0) == floor  # nothing heard yet
    feed(m, be, parse_sample("", metric_names(be)), 1.0)
    assert be.scale(1.0) == 1.0  # idle-but-unknown
    held = [try_acquire(be, "hi", "a", None, 400, 1.0) for _ in range(3)]
    assert [isinstance(h, Hold) for h in held] == [True, True, False]  # the reservations bound KV: 800 of 1000
    st = be.status(1.0)
    assert st["metrics_state"] == "no_series" and st["kv_source"] == "reservations"
    assert st["kv_usage"] == pytest.approx(0.8) and st["metrics_problem"] is None


def test_unreachable_still_counts_as_saturated() -> None:
    m, be = Metrics(), backend("sglang")
    feed(m, be, parse_sample((FIXTURES / "sglang.prom").read_text(), metric_names(be)), 1.0)
    assert be.scale(1.0) == 1.0
    feed(m, be, Sample(ok=False, state="unreachable", error="ClientConnectorError"), 2.0)
    assert be.scale(2.0) == be.spec.watermark.floor
    assert be.status(2.0)["kv_source"] == "saturated"
    assert m.registry.get_sample_value("sluice_backend_scrape_errors_total", {"backend": "b"}) == 1.0


def test_engine_kv_drives_the_watermark() -> None:
    m, be = Metrics(), backend("vllm")
    feed(m, be, parse_sample((FIXTURES / "vllm_dp2.prom").read_text(), metric_names(be)), 1.0)
    st = be.status(1.0)
    assert st["kv_source"] == "engine" and st["kv_usage"] == pytest.approx(0.81) and st["waiting"] == 7.0
    assert be.scale(1.0) < 1.0  # 0.81 is between the watermarks
    assert m.registry.get_sample_value("sluice_backend_kv_usage", {"backend": "b"}) == pytest.approx(0.81)


def test_queue_only_engine_takes_its_queue_as_pressure() -> None:
    m, be = Metrics(), backend("llamacpp", watermark={"waiting_threshold": 2})
    feed(m, be, parse_sample((FIXTURES / "llamacpp.prom").read_text(), metric_names(be)), 1.0)  # 3 deferred
    assert be.scale(1.0) == be.spec.watermark.floor
    st = be.status(1.0)
    assert st["kv_source"] == "reservations" and st["waiting"] == 3.0 and st["running"] == 4.0
    assert st["metrics_state"] == "ok" and st["kv_usage"] == 0.0


def test_a_problem_is_said_once_and_cleared(caplog: pytest.LogCaptureFixture) -> None:
    m, be = Metrics(), backend("trtllm")
    json_answer = classify_answer(200, "application/json", (FIXTURES / "trtllm_serve_metrics.json").read_text(),
                                  metric_names(be))
    assert json_answer is not None
    with caplog.at_level(logging.INFO, logger="sluice.monitor"):
        for t in (1.0, 2.0, 3.0):
            feed(m, be, json_answer, t)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "/prometheus/metrics" in errors[0].getMessage() and URL in errors[0].getMessage()
    assert problem_gauge(m, "not_prometheus") == 1.0
    assert be.scale(3.0) == 1.0  # not saturated forever: the reservations bound admission meanwhile
    st = be.status(3.0)
    assert st["metrics_state"] == "problem" and st["scrape_ok"] is False
    assert st["metrics_problem"]["problem"] == "not_prometheus"
    assert "return_perf_metrics" in st["metrics_problem"]["hint"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sluice.monitor"):
        feed(m, be, parse_sample((FIXTURES / "trtllm_serve.prom").read_text(), metric_names(be)), 4.0)
    assert problem_gauge(m, "not_prometheus") == 0.0
    assert any("no longer not_prometheus (now ok)" in r.getMessage() for r in caplog.records)
    assert be.status(4.0)["metrics_problem"] is None


def test_a_different_problem_replaces_the_first() -> None:
    m, be = Metrics(), backend("vllm")
    feed(m, be, Sample(ok=False, state="problem", problem="http_404", error="HTTP 404"), 1.0)
    feed(m, be, parse_sample((FIXTURES / "vllm_disable_log_stats.prom").read_text(), metric_names(be)), 2.0)
    assert problem_gauge(m, "http_404") == 0.0 and problem_gauge(m, "no_engine_metrics") == 1.0
    assert "--disable-log-stats" in be.status(2.0)["metrics_problem"]["hint"]


def test_sglang_retractions_trip_the_breaker() -> None:
    m, be = Metrics(), backend("sglang")
    names = metric_names(be)
    feed(m, be, parse_sample('sglang:token_usage{model_name="m"} 0.5\n', names), 1.0)  # counter not there yet: 0
    assert be.breaker.state(1.0).value == "closed"
    feed(m, be, parse_sample((FIXTURES / "sglang.prom").read_text(), names), 2.0)  # 48 retractions
    assert be.breaker.state(2.0).value == "open"


def test_policy_accepts_the_new_engines_and_checks_selectors() -> None:
    for engine in ("triton", "llamacpp", "tgi"):
        assert backend(engine).spec.engine == engine
    be = backend("triton", metric_names={"waiting": ['nv_trt_llm_request_metrics{request_type="waiting"}']})
    assert metric_names(be).waiting[0].labels == (("request_type", "waiting"),)
    with pytest.raises(PolicyError, match=r"metric_names\.kv_usage\[0\].*only label"):
        backend("triton", metric_names={"kv_usage": ['m{a!="x"}']})


def test_the_monitor_reports_a_wrong_metrics_url_in_state_and_metrics() -> None:
    """The real scrape loop against a real HTTP server: trtllm-serve's JSON /metrics, then the
    right exposition. /debug/state (Runtime.status) and /metrics say it, then clear it."""
    answer = {"ctype": "application/json", "body": (FIXTURES / "trtllm_serve_metrics.json").read_text()}

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=answer["body"].encode(), headers={"Content-Type": answer["ctype"]})

    async def run(rt: Runtime) -> None:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        rt.swap(policy("trtllm", f"http://127.0.0.1:{port}/metrics", watermark={"scrape_interval_s": 0.2}))
        monitor = asyncio.create_task(run_monitor(rt))
        try:
            st = await eventually_async(lambda: rt.status()["backends"]["b"]["metrics_problem"], 20,
                                        "the problem in the status")
            assert st["problem"] == "not_prometheus" and "/prometheus/metrics" in st["hint"]
            assert rt.metrics.registry.get_sample_value(
                "sluice_backend_metrics_problem", {"backend": "b", "problem": "not_prometheus"}) == 1.0
            assert rt.status()["backends"]["b"]["scale"] == 1.0  # not held at the floor
            be = rt.backends["b"]
            hold = try_acquire(be, "hi", "a", None, 400, rt.clock())
            assert isinstance(hold, Hold)
            # Meanwhile the KV shown is Sluice's own reservations (400 of 1000 tokens).
            await eventually_async(lambda: rt.metrics.registry.get_sample_value(
                "sluice_backend_kv_usage", {"backend": "b"}) == pytest.approx(0.4), 20, "the reserved KV gauge")
            assert rt.status()["backends"]["b"]["kv_usage"] == pytest.approx(0.4)
            be.release(hold, rt.clock())
            answer.update(ctype="text/plain; version=0.0.4", body=(FIXTURES / "trtllm_serve.prom").read_text())
            await eventually_async(lambda: rt.status()["backends"]["b"]["kv_source"] == "engine", 20, "the engine's KV")
            b = rt.status()["backends"]["b"]
            assert b["metrics_problem"] is None and b["kv_usage"] == pytest.approx(0.5625) and b["waiting"] == 5.0
            assert rt.metrics.registry.get_sample_value(
                "sluice_backend_metrics_problem", {"backend": "b", "problem": "not_prometheus"}) == 0.0
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            await runner.cleanup()

    rt = Runtime(policy("trtllm"))
    try:
        asyncio.run(run(rt))
    finally:
        rt.close()
