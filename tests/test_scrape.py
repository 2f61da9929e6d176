"""Engine expositions as the engines write them: presets, label matchers, ranks, and the
four states a scrape can end in (ok, no series yet, problem, unreachable)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.procs import free_port
from extproc.backends.scrape import (
    Sample,
    classify_answer,
    kv_fraction,
    kv_source,
    parse_sample,
    scrape_once,
)
from extproc.policy.engine_metrics import PRESETS, Selector, engine_metrics, parse_selector

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- selectors ------------------------------------------------------------------------

def test_selector_forms() -> None:
    assert parse_selector("vllm:num_requests_waiting") == Selector("vllm:num_requests_waiting")
    quoted = parse_selector('nv_trt_llm_request_metrics{request_type="waiting", model="tensorrt_llm"}')
    assert quoted == Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"), ("model", "tensorrt_llm")))
    # The spelling the Gateway API Inference Extension uses: unquoted values.
    assert parse_selector("nv_trt_llm_request_metrics{request_type=waiting}") == \
        Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"),))
    assert parse_selector('m{a="x\\"y",}').labels == (("a", 'x"y'),)
    assert str(quoted) == 'nv_trt_llm_request_metrics{request_type="waiting",model="tensorrt_llm"}'
    assert quoted.matches("nv_trt_llm_request_metrics",
                          {"request_type": "waiting", "model": "tensorrt_llm", "version": "1"})
    assert not quoted.matches("nv_trt_llm_request_metrics", {"request_type": "waiting"})


@pytest.mark.parametrize("bad, why", [
    ("", "starts with a metric name"),
    ("9lives", "starts with a metric name"),
    ('m{a!="x"}', "only label"),
    ('m{a=~"x.*"}', "only label"),
    ('m{a="x"', "expected name or"),
    ('m{a="x" b="y"}', "expected ','"),
    ('m{a="x",a="y"}', "matched twice"),
    ("m{=x}", "expected a label name"),
])
def test_bad_selectors_say_why(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_selector(bad)


# -- one exposition per engine ---------------------------------------------------------

@pytest.mark.parametrize("engine, name, kv, waiting, running, preemptions", [
    ("vllm", "vllm_dp2.prom", 0.81, 7.0, 21.0, 7.0),  # two engines: KV max, queues and counters summed
    ("sglang", "sglang.prom", 0.28, 2.0, 7.0, 48.0),  # the retraction counter, not the per-batch gauge (1)
    ("trtllm", "trtllm_serve.prom", 0.5625, 5.0, 16.0, None),
    ("triton", "triton_trtllm.prom", 0.244140625, 2.0, 6.0, None),
    ("llamacpp", "llamacpp.prom", None, 3.0, 4.0, None),  # no KV metric since llama.cpp PR #13660
    ("tgi", "tgi.prom", None, 5.0, 8.0, None),
])
def test_each_engine_reads_as_documented(engine: str, name: str, kv: float | None, waiting: float,
                                         running: float, preemptions: float | None) -> None:
    s = parse_sample(fixture(name), PRESETS[engine])
    assert (s.state, s.ok, s.problem) == ("ok", True, "")
    assert s.kv_usage == (pytest.approx(kv) if kv is not None else None)
    assert (s.waiting, s.running, s.preemptions) == (waiting, running, preemptions)
    assert kv_source(s) == ("engine" if kv is not None else "reservations")


def test_data_parallel_ranks_combine_kv_max_and_queues_summed() -> None:
    ranks = "\n".join(
        f'vllm:kv_cache_usage_perc{{engine="{r}",model_name="m"}} {kv}\n'
        f'vllm:num_requests_waiting{{engine="{r}",model_name="m"}} {w}\n'
        f'vllm:num_requests_running{{engine="{r}",model_name="m"}} {n}\n'
        f'vllm:num_preemptions_total{{engine="{r}",model_name="m"}} {p}'
        for r, (kv, w, n, p) in enumerate([(0.10, 1, 5, 0), (0.93, 6, 9, 4), (0.50, 0, 7, 1), (0.20, 2, 3, 0)]))
    s = parse_sample(ranks + "\n", PRESETS["vllm"])
    assert s.kv_usage == pytest.approx(0.93) and s.kv_series == 4  # the fullest rank binds
    assert (s.waiting, s.running, s.preemptions) == (9.0, 24.0, 5.0)


def test_triton_needs_label_matchers() -> None:
    text = fixture("triton_trtllm.prom")
    # Names alone mix every quantity of a family: the bug the issue reports (KV 40.96, waiting 297).
    by_name = engine_metrics("triton", {"kv_usage": ("nv_trt_llm_kv_cache_block_metrics",),
                                        "waiting": ("nv_trt_llm_request_metrics",)})
    wrong = parse_sample(text, by_name)
    assert wrong.kv_usage == 1.0 and wrong.waiting == 273.0  # max block count as percent, clamped; a sum
    # Matchers in an override, in either spelling, pick the one series that means it.
    matched = engine_metrics(
        "triton",
        {
            "kv_usage": ("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",),
            "waiting": ('nv_trt_llm_request_metrics{request_type="waiting"}',),
        },
    )
    right = parse_sample(text, matched)
    assert right.kv_usage == pytest.approx(0.244140625) and right.waiting == 2.0 and right.running == 6.0


def test_override_falls_back_in_order_and_keeps_other_kinds() -> None:
    m = engine_metrics("vllm", {"kv_usage": ("my:kv_percent", "vllm:kv_cache_usage_perc")})
    assert m.waiting == PRESETS["vllm"].waiting and m.kv_unit == "auto"
    assert parse_sample("my:kv_percent 85\n", m).kv_usage == pytest.approx(0.85)
    assert parse_sample('vllm:kv_cache_usage_perc{engine="0"} 0.3\n', m).kv_usage == pytest.approx(0.3)
    # An explicit empty list turns the KV metric off: queue-only, like llama.cpp.
    off = parse_sample(fixture("vllm_dp2.prom"), engine_metrics("vllm", {"kv_usage": ()}))
    assert off.state == "ok" and off.kv_usage is None and off.waiting == 7.0


def test_kv_units_clamp_instead_of_reading_rounding_noise_as_percent() -> None:
    assert kv_fraction(1.0000001, "fraction") == 1.0
    assert kv_fraction(1.0000001, "auto") == 1.0  # full, not 0.01 (idle)
    assert kv_fraction(1.4, "auto") == 1.0
    assert kv_fraction(85.0, "auto") == pytest.approx(0.85)
    assert kv_fraction(150.0, "auto") == 1.0
    assert kv_fraction(85.0, "fraction") == 1.0  # a preset is a fraction: nonsense reads as full
    assert kv_fraction(-0.1, "fraction") == 0.0
    assert kv_fraction(42.0, "percent") == pytest.approx(0.42)
    assert parse_sample("vllm:kv_cache_usage_perc 1.0000001\n", PRESETS["vllm"]).kv_usage == 1.0


def test_nan_series_are_ignored() -> None:
    s = parse_sample('vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n',
                     PRESETS["vllm"])
    assert s.kv_usage == pytest.approx(0.4) and s.kv_series == 1


# -- states ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine, text", [
    ("sglang", ""),  # multiprocess mode: nothing at all before the first batch
    ("sglang", "# HELP sglang:token_usage The token usage\n# TYPE sglang:token_usage gauge\n"),
    ("trtllm", "# HELP trtllm_e2e_request_latency_seconds x\n# TYPE trtllm_e2e_request_latency_seconds histogram\n"),
    ("triton", 'nv_inference_request_success{model="ensemble",version="1"} 0\n'),
])
def test_lazy_gauges_before_the_first_batch_are_idle_but_unknown(engine: str, text: str) -> None:
    s = parse_sample(text, PRESETS[engine])
    assert s.state == "no_series" and s.ok and s.kv_usage is None
    assert kv_source(s) == "reservations"  # not "saturated"


def test_queue_only_engine_before_its_first_request_has_no_queue_yet() -> None:
    s = parse_sample("# TYPE tgi_request_count counter\ntgi_request_count 0\n", PRESETS["tgi"])
    assert s.state == "ok" and s.kv_usage is None and s.waiting is None and kv_source(s) == "reservations"


def test_lazy_counter_absent_reads_as_zero_so_the_first_retractions_count() -> None:
    s = parse_sample('sglang:token_usage{model_name="m"} 0.5\n', PRESETS["sglang"])
    assert s.preemptions == 0.0
    assert parse_sample(fixture("trtllm_serve.prom"), PRESETS["trtllm"]).preemptions is None  # nothing to read


def test_vllm_with_disable_log_stats_is_a_problem_not_silence() -> None:
    s = parse_sample(fixture("vllm_disable_log_stats.prom"), PRESETS["vllm"])
    assert (s.state, s.problem) == ("problem", "no_engine_metrics")
    assert "--disable-log-stats" in s.hint and kv_source(s) == "reservations"


def test_an_eager_engine_without_its_kv_name_is_a_problem() -> None:
    s = parse_sample('vllm:num_requests_waiting{engine="0"} 1\nvllm:kv_cache_usage_ratio 0.4\n', PRESETS["vllm"])
    assert (s.state, s.problem) == ("problem", "kv_metric_missing")
    assert "metric_names.kv_usage" in s.hint and "vllm:kv_cache_usage_perc" in s.error


def test_trtllm_serve_json_is_named_with_the_fix() -> None:
    text = fixture("trtllm_serve_metrics.json")
    s = classify_answer(200, "application/json", text, PRESETS["trtllm"])
    assert s is not None and (s.state, s.problem) == ("problem", "not_prometheus")
    assert "/prometheus/metrics" in s.hint and "return_perf_metrics" in s.hint and "enable_iter_perf_stats" in s.hint
    # The same body served as text/plain is recognised too.
    t = classify_answer(200, "text/plain", text, PRESETS["trtllm"])
    assert t is not None and t.problem == "not_prometheus"
    # Even past the sniffing, an unparseable body is a problem, not an empty scrape.
    assert parse_sample(text, PRESETS["trtllm"]).problem == "not_prometheus"


def test_status_codes() -> None:
    nf = classify_answer(404, "text/plain", "Not Found", PRESETS["trtllm"])
    assert nf is not None and nf.problem == "http_404" and "return_perf_metrics" in nf.hint
    ni = classify_answer(501, "application/json", "{}", PRESETS["llamacpp"])
    assert ni is not None and ni.problem == "http_501" and "--metrics" in ni.hint
    busy = classify_answer(503, "text/plain", "Loading model", PRESETS["llamacpp"])
    assert busy is not None and busy.state == "unreachable" and kv_source(busy) == "saturated"
    assert classify_answer(200, "text/plain; version=0.0.4", fixture("sglang.prom"), PRESETS["sglang"]) is None
    assert kv_source(None) == "saturated"
    assert kv_source(Sample(ok=False, state="unreachable", error="x")) == "saturated"


# -- over HTTP ------------------------------------------------------------------------

def test_scrape_once_over_http_tells_the_states_apart() -> None:
    routes = {
        "/metrics": (200, "text/plain; version=0.0.4", fixture("vllm_dp2.prom")),
        "/json": (200, "application/json", fixture("trtllm_serve_metrics.json")),
        "/off": (200, "text/plain; version=0.0.4", fixture("vllm_disable_log_stats.prom")),
        "/lazy": (200, "text/plain; version=0.0.4", ""),
        "/down": (500, "text/plain", "boom"),
    }
    binary = b"\x1f\x8b\x08\x00\xff\xfe\xfd"

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/bin":
            return web.Response(body=binary, headers={"Content-Type": "application/octet-stream"})
        if request.path not in routes:
            return web.Response(status=404, text="404: Not Found")
        status, ctype, body = routes[request.path]
        return web.Response(status=status, body=body.encode(), headers={"Content-Type": ctype})

    async def run() -> dict[str, Sample]:
        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        closed = free_port()
        out: dict[str, Sample] = {}
        try:
            async with aiohttp.ClientSession() as session:
                for path, engine in [("/metrics", "vllm"), ("/json", "trtllm"), ("/off", "vllm"),
                                     ("/lazy", "sglang"), ("/down", "vllm"), ("/prometheus/metrics", "trtllm"),
                                     ("/bin", "vllm")]:
                    out[path] = await scrape_once(session, f"http://127.0.0.1:{port}{path}", PRESETS[engine], 2.0)
                out["closed"] = await scrape_once(session, f"http://127.0.0.1:{closed}/metrics", PRESETS["vllm"], 2.0)
        finally:
            await runner.cleanup()
        return out

    got = asyncio.run(run())
    assert got["/metrics"].state == "ok" and got["/metrics"].kv_usage == pytest.approx(0.81)
    assert got["/json"].problem == "not_prometheus"
    assert got["/off"].problem == "no_engine_metrics"
    assert got["/lazy"].state == "no_series"
    assert got["/down"].state == "unreachable" and got["/down"].error == "HTTP 500"
    assert got["/prometheus/metrics"].problem == "http_404"
    assert got["/bin"].problem == "not_prometheus"
    assert got["closed"].state == "unreachable" and kv_source(got["closed"]) == "saturated"
