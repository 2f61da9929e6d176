"""The benchmark's traffic and arithmetic: trace loading, schedules, the TPM window contract."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from bench.loadgen import Result, prompt_text
from bench.metrics import (
    max_window_ratio,
    pct,
    rate_per_minute,
    spread_rate_per_minute,
    tokens_between,
)
from bench.stack import envoy_config, example_policy, local_ratelimit_filter
from bench.trace import (
    CHAT_MODEL,
    CHAT_WINDOW,
    LONG_MODEL,
    TRACE_PATH,
    Mix,
    Phase,
    TraceRow,
    build_schedule,
    load_trace,
    sample_mix,
)
from extproc.envoy.bootstrap import EXTPROC_CLUSTER, EXTPROC_FILTER, BackendRoute, EnvoyOptions

ROWS = [TraceRow(i * 0.5 + (0.2 if i % 3 == 0 else 0.0), 200 + 37 * (i % 50), 10 + 7 * (i % 40))
        for i in range(400)]
PHASES = [Phase("steady", 10, 0.9), Phase("burst", 6, 3.0), Phase("recovery", 8, 0.6)]


@pytest.mark.skipif(not TRACE_PATH.exists(), reason="the Azure trace is not checked out next to the repo")
def test_load_trace_reads_the_whole_hour_in_order() -> None:
    rows = load_trace()
    assert len(rows) == 19366
    assert rows[0].t == 0.0
    assert all(a.t <= b.t for a, b in zip(rows, rows[1:], strict=False))
    assert 3400 < rows[-1].t < 3600
    assert all(r.prompt > 0 and r.gen > 0 for r in rows)


def test_load_trace_parses_seven_fractional_digits(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.1805900,10,0\n"
                 "2023-11-16 18:15:46.6805900,374,44\n")
    rows = load_trace(f)
    assert [(r.t, r.prompt, r.gen) for r in rows] == [(0.0, 374, 44), (pytest.approx(0.5), 10, 1)]


def test_schedule_is_deterministic_and_seeded() -> None:
    a = build_schedule(ROWS, PHASES, 5.0, seed=1)
    b = build_schedule(ROWS, PHASES, 5.0, seed=1)
    c = build_schedule(ROWS, PHASES, 5.0, seed=2)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert [r.id for r in a.requests] == list(range(len(a.requests)))
    assert all(x.at <= y.at for x, y in zip(a.requests, a.requests[1:], strict=False))


def test_phases_are_sized_as_asked() -> None:
    mix = Mix()
    s = build_schedule(ROWS, PHASES, 5.0, mix, seed=3)
    assert s.bounds == {"steady": (0, 10), "burst": (10, 16), "recovery": (16, 24)}
    assert s.seconds == 24
    chat_frac = 1 / (1 + mix.batch_share)
    for ph in PHASES:
        lo, hi = s.bounds[ph.name]
        reqs = s.in_phase(ph.name)
        assert all(lo <= r.at < hi for r in reqs)
        chat = [r for r in reqs if r.tier != "batch"]
        batch = [r for r in reqs if r.tier == "batch"]
        assert len(chat) == round(ph.load * 5.0 * chat_frac * ph.seconds)
        assert len(batch) == round(ph.load * 5.0 * (1 - chat_frac) * ph.seconds)
    # The burst offers ~3x the steady phase's rate, recovery ~2/3 of it.
    rate = {p.name: len(s.in_phase(p.name)) / p.seconds for p in PHASES}
    assert rate["burst"] / rate["steady"] == pytest.approx(3 / 0.9, rel=0.1)
    assert rate["recovery"] / rate["steady"] == pytest.approx(0.6 / 0.9, rel=0.15)


def test_tenants_models_and_lengths() -> None:
    mix = Mix()
    s = build_schedule(ROWS, [Phase("only", 200, 1.0)], 5.0, mix, seed=4)
    tiers = Counter(r.tier for r in s.requests)
    assert set(tiers) == {"premium", "free", "batch"}
    assert tiers["premium"] / (tiers["premium"] + tiers["free"]) == pytest.approx(mix.premium_share, abs=0.05)
    for r in s.requests:
        if r.tier == "batch":
            assert r.model == LONG_MODEL and r.max_tokens == mix.batch_max_tokens
            assert mix.batch_prompt_range[0] <= r.prompt_tokens <= mix.batch_prompt_range[1]
        else:
            assert r.model == CHAT_MODEL
            assert r.max_tokens == (mix.premium_max_tokens if r.tier == "premium" else mix.free_max_tokens)
            assert r.prompt_tokens + r.max_tokens <= CHAT_WINDOW
        assert 1 <= r.gen_tokens <= r.max_tokens
    # Chat requests replay consecutive trace rows (from a seeded start, wrapping around).
    pairs = [(r.prompt_tokens, r.gen_tokens) for r in s.requests if r.tier != "batch"]
    n = len(ROWS)
    assert any(all(pairs[k] == (ROWS[(st + k) % n].prompt, ROWS[(st + k) % n].gen) for k in range(len(pairs)))
               for st in range(n))


def test_sample_mix_interleaves_batch_evenly() -> None:
    reqs = sample_mix(ROWS, 270, Mix(batch_share=0.04), seed=1)
    batch = [i for i, r in enumerate(reqs) if r.tier == "batch"]
    assert len(batch) == 10
    assert {b - a for a, b in zip(batch, batch[1:], strict=False)} == {26}  # 1 batch per 25 chat
    assert sample_mix(ROWS, 50, seed=9) == sample_mix(ROWS, 50, seed=9)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        build_schedule(ROWS, PHASES, 0.0)
    with pytest.raises(ValueError):
        build_schedule(ROWS, [Phase("x", 0, 1.0)], 5.0)


# ---- the TPM window contract --------------------------------------------------------
def test_window_ratio_by_hand() -> None:
    # burst 100, TPM 60 (1 token/s). [0, 10]: 200 / (100 + 10) is the worst window;
    # [0, 70] is longer than 60 s and does not count.
    ratio, at, width = max_window_ratio([(70.0, 100), (0.0, 100), (10.0, 100)], burst=100, tpm=60)
    assert ratio == pytest.approx(200 / 110)
    assert (at, width) == (0.0, 10.0)


def test_window_ratio_of_a_bucket_that_keeps_its_contract() -> None:
    # The whole burst at t=0, then exactly the refill rate: every window is within the bound.
    events = [(0.0, 1000)] + [(float(t), 10) for t in range(1, 200)]
    ratio, _, _ = max_window_ratio(events, burst=1000, tpm=600)
    assert ratio == pytest.approx(1.0)
    # One extra request's worth sneaking in breaks it by exactly that much.
    ratio, _, _ = max_window_ratio([*events, (30.0, 100)], burst=1000, tpm=600)
    assert ratio == pytest.approx((1000 + 300 + 100) / (1000 + 300))


def test_spread_rate_counts_the_part_of_each_response_inside_the_window() -> None:
    # 100 tokens over [0, 10]: a window [5, 15) holds half of them: 50 in 10 s = 300/min.
    assert spread_rate_per_minute([(0.0, 10.0, 100)], 5.0, 15.0) == pytest.approx(300.0)
    # Back-to-back responses at a constant rate give that rate in any window, edges or not,
    # where counting each at its end jumps by one response as an end crosses the edge.
    spans = [(10.0 * k, 10.0 * (k + 1), 100) for k in range(20)]
    ends = [(e, n) for _, e, n in spans]
    assert rate_per_minute(ends, 28.0, 53.0) == pytest.approx(720.0)  # three ends in 25 s
    assert rate_per_minute(ends, 31.0, 56.0) == pytest.approx(480.0)  # two
    assert spread_rate_per_minute(spans, 28.0, 53.0) == pytest.approx(600.0)
    assert spread_rate_per_minute(spans, 31.0, 56.0) == pytest.approx(600.0)
    # an instant response counts whole where it ends; an empty window has no rate
    assert spread_rate_per_minute([(4.0, 4.0, 60)], 0.0, 60.0) == pytest.approx(60.0)
    assert math.isnan(spread_rate_per_minute(spans, 5.0, 5.0))


def test_window_ratio_empty_and_steady_rate() -> None:
    assert max_window_ratio([], 100, 60)[0] == 0.0
    events = [(float(t), 50) for t in range(0, 120)]
    assert rate_per_minute(events, 60, 120) == pytest.approx(3000)
    assert math.isnan(rate_per_minute(events, 5, 5))


def test_tokens_between_spreads_a_stream_over_its_duration() -> None:
    r = Result(1, "premium", "x", sent=0.0, status=200, first=1.0, end=5.0, tokens=40, done=True)
    assert tokens_between([r], 0, 3) == pytest.approx(20)
    assert tokens_between([r], 3, 10) == pytest.approx(20)
    failed = Result(2, "premium", "x", sent=0.0, status=200, first=1.0, end=5.0, tokens=40, gave_up="ttft")
    assert tokens_between([failed], 0, 10) == 0
    assert pct([3, 1, 2, 4], 0.5) == 2 and math.isnan(pct([], 0.5))


# ---- the bits the configurations are built from -------------------------------------
def test_prompt_text_is_one_token_per_word() -> None:
    assert len(prompt_text(106).split()) == 100


def test_envoy_shapes() -> None:
    opts = EnvoyOptions(listen_port=1, admin_port=2, extproc_port=3)
    routes = [BackendRoute("sim", "127.0.0.1", 4)]

    def filters(cfg: dict) -> list[str]:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return [f["name"] for f in hcm["http_filters"]]

    def clusters(cfg: dict) -> list[str]:
        return [c["name"] for c in cfg["static_resources"]["clusters"]]

    assert filters(envoy_config("sluice", routes, opts)) == [
        "envoy.filters.http.header_mutation", EXTPROC_FILTER, "envoy.filters.http.lua",
        "envoy.filters.http.router"]
    plain = envoy_config("none", routes, opts)
    assert filters(plain) == ["envoy.filters.http.router"] and EXTPROC_CLUSTER not in clusters(plain)
    # Nothing reads the usage without ext_proc: no upstream usage filter on the backends.
    assert all("http_filters" not in o for c in plain["static_resources"]["clusters"]
               for o in c.get("typed_extension_protocol_options", {}).values())
    limited = envoy_config("ratelimit", routes, opts, rps=4.8)
    assert filters(limited) == ["envoy.filters.http.local_ratelimit", "envoy.filters.http.router"]
    bucket = local_ratelimit_filter(4.8)["typed_config"]["token_bucket"]
    assert bucket == {"max_tokens": 5, "tokens_per_fill": 1, "fill_interval": "0.208s"}


def test_example_policy_rewrites_only_addresses(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "policies"
    dest = example_policy(tmp_path / "p", {"sim": 1234, "sim-small": 5678})
    for f in src.glob("*.yaml"):
        before, after = yaml.safe_load(f.read_text()), yaml.safe_load((dest / f.name).read_text())
        if "backends" not in (before or {}):
            assert (dest / f.name).read_text() == f.read_text()
            continue
        for b0, b1 in zip(before["backends"], after["backends"], strict=True):
            port = {"sim": 1234, "sim-small": 5678}[b0["name"]]
            if "endpoints" in b0:  # a pool runs as its first endpoint
                first = b0.pop("endpoints")[0]
                b0.update({k: v for k, v in first.items() if k in ("kv_capacity_tokens", "max_concurrency")})
                b0["metrics_url"] = first["metrics_url"]
            assert b1["address"] == f"127.0.0.1:{port}"
            assert b1["metrics_url"] == f"http://127.0.0.1:{port}/metrics"
            assert {k: v for k, v in b1.items() if k not in ("address", "metrics_url")} == \
                {k: v for k, v in b0.items() if k not in ("address", "metrics_url")}


def test_tpm_ledger_check_allows_only_the_estimated_responses_error() -> None:
    from bench.tpm import ledger_matches
    assert ledger_matches(177_470, 177_470, 0, 500.0)
    assert not ledger_matches(177_470, 177_471, 0, 500.0)  # nothing estimated: exact or missed
    assert ledger_matches(177_470, 177_477, 1, 500.0)  # one estimate, 7 tokens off
    assert not ledger_matches(177_470, 177_700, 1, 500.0)  # beyond one estimate's 25 %
    assert not ledger_matches(1, None, 5, 500.0)
