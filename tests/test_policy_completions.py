"""Learned completion lengths: quantile, fallbacks, cap at max_tokens, decay, bounded memory, round trip."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.completions import (
    MAX_BUCKET,
    CompletionEstimator,
    LengthHistogram,
    bucket_of,
    upper_bound,
)


def test_buckets_hold_their_values() -> None:
    for v in [0, 1, 2, 3, 7, 16, 100, 210, 1023, 1024, 32768, 131072]:
        i = bucket_of(v)
        assert upper_bound(i) >= v
        assert i == 0 or upper_bound(i - 1) < v
        assert upper_bound(i) <= max(2, v * 1.1 + 1)


@given(st.integers(0, 1 << 20))
def test_bucket_bounds_property(v: int) -> None:
    i = bucket_of(v)
    assert 0 <= i <= MAX_BUCKET
    assert upper_bound(i) >= v
    assert upper_bound(i) <= max(2, v * 1.1 + 1)


def test_high_quantile_of_a_known_distribution() -> None:
    h = LengthHistogram(half_life=10_000)
    for v in range(1, 1001):  # uniform 1..1000: p95 is 950
        h.add(v)
    q = h.quantile(0.95)
    assert 950 <= q <= 950 * 1.1 + 1


def test_falls_back_from_tenant_to_tier_to_max_tokens() -> None:
    est = CompletionEstimator(min_samples=5)
    assert est.estimate("acme", "free", "m", 512).source == "max_tokens"
    assert est.estimate("acme", "free", "m", 512).tokens == 512
    for _ in range(5):
        est.observe("other", "free", "m", 100)
    e = est.estimate("acme", "free", "m", 512)
    assert e.source == "tier" and 100 <= e.tokens <= 111
    for _ in range(5):
        est.observe("acme", "free", "m", 40)
    e = est.estimate("acme", "free", "m", 512)
    assert e.source == "tenant" and 40 <= e.tokens <= 45
    # Another model has learned nothing.
    assert est.estimate("acme", "free", "m2", 512).source == "max_tokens"
    assert est.learned("tier", "free", "m2") is None
    assert est.learned("tier", "free", "m") == est.estimate("x", "free", "m", 10**6).tokens


def test_the_quantile_can_be_chosen_per_request() -> None:
    est = CompletionEstimator(min_samples=5, half_life=10_000)
    for v in range(1, 1001):
        est.observe("a", "t", "m", v)
    assert 500 <= est.estimate("a", "t", "m", 4096, quantile=0.5).tokens <= 551
    assert est.estimate("a", "t", "m", 4096).tokens >= 950


def test_never_above_max_tokens() -> None:
    est = CompletionEstimator(min_samples=1)
    est.observe("a", "t", "m", 5000)
    assert est.estimate("a", "t", "m", 256).tokens == 256


def test_no_completion_reserves_nothing() -> None:
    est = CompletionEstimator(min_samples=1)
    est.observe("a", "t", "m", 50)
    assert est.estimate("a", "t", "m", 0).tokens == 0
    assert est.estimate("a", "t", "m", 1).tokens == 1


def test_recent_samples_win() -> None:
    est = CompletionEstimator(min_samples=5, half_life=20)
    for _ in range(200):
        est.observe("a", "t", "m", 1000)
    assert est.estimate("a", "t", "m", 4096).tokens >= 1000
    for _ in range(200):
        est.observe("a", "t", "m", 50)
    assert est.estimate("a", "t", "m", 4096).tokens <= 56


def test_renormalisation_keeps_the_estimate() -> None:
    h = LengthHistogram(half_life=1.0)  # weight doubles each sample: renormalises often
    for i in range(2000):
        h.add(100 if i % 2 else 300)
    assert h.weight < 1e100
    assert h.quantile(0.95) in (upper_bound(bucket_of(100)), upper_bound(bucket_of(300)))


def test_keys_are_capped_least_recent_first() -> None:
    est = CompletionEstimator(min_samples=1, max_keys=10)
    for i in range(100):
        est.observe(f"tenant{i}", "t", "m", 10)
    assert len(est) <= 10
    assert est.estimate("tenant99", "t", "m", 100).source == "tenant"
    assert est.estimate("tenant0", "t", "m", 100).source == "tier"  # tier key is the most used


def test_round_trips_through_json() -> None:
    est = CompletionEstimator(min_samples=3)
    rng = random.Random(7)
    for _ in range(300):
        est.observe(rng.choice(["a", "b"]), "free", rng.choice(["m1", "m2"]), rng.randint(1, 900))
    back = CompletionEstimator.from_dict(json.loads(json.dumps(est.to_dict())))
    for tenant in ("a", "b", "zz"):
        for model in ("m1", "m2"):
            assert back.estimate(tenant, "free", model, 1024) == est.estimate(tenant, "free", model, 1024)
    # And it keeps learning afterwards in step with the original.
    for _ in range(50):
        est.observe("a", "free", "m1", 5)
        back.observe("a", "free", "m1", 5)
    assert back.estimate("a", "free", "m1", 1024).tokens == est.estimate("a", "free", "m1", 1024).tokens


def test_snapshot_reports_recent_keys() -> None:
    est = CompletionEstimator(min_samples=2)
    est.observe("a", "free", "m", 100)
    snap = est.snapshot()
    assert snap["keys"] == 2
    first = snap["estimates"][0]
    assert first["model"] == "m" and first["samples"] == 1 and first["trusted"] is False


@pytest.mark.parametrize("kw", [{"quantile": 0}, {"half_life": 0}, {"min_samples": 0}, {"max_keys": 1}])
def test_settings_are_checked(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CompletionEstimator(**kw)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 100_000)), max_size=300),
       st.integers(0, 200_000))
def test_estimate_is_positive_capped_and_covers_the_quantile(obs: list[tuple[str, int]], max_tokens: int) -> None:
    est = CompletionEstimator(min_samples=1, half_life=1e9, max_keys=4)
    for tenant, n in obs:
        est.observe(tenant, "t", "m", n)
    for tenant in ("a", "b", "c", "d"):
        e = est.estimate(tenant, "t", "m", max_tokens)
        assert min(1, max_tokens) <= e.tokens <= max_tokens
        mine = sorted(n for t, n in obs if t == tenant)
        if e.source == "tenant" and mine:
            # Without decay the estimate is at least the true 95th percentile (nearest rank),
            # unless max_tokens caps it.
            rank = max(1, -(-95 * len(mine) // 100))
            assert e.tokens >= min(max_tokens, mine[rank - 1], max(1, mine[rank - 1]))
    assert len(est) <= 4
