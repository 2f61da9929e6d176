"""Adaptive concurrency limit: converges, holds after a step change, keeps its floor, recovers.

Time is passed in; a toy backend (latency flat up to a knee, then growing with
concurrency, as a batch past its sweet spot) closes the loop.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.concurrency import AdaptiveConfig, AdaptiveLimit, quantile


def plant(limit: int, base: float, knee: int) -> float:
    """Normalised latency (latency / SLO) with ``limit`` requests in flight."""
    return base * max(1.0, limit / knee)


def run(ctl: AdaptiveLimit, t: float, windows: int, base: float, knee: int, tier: str = "t") -> tuple[float, list[int]]:
    """Drive ``windows`` windows of saturating load; returns the time and the limit after each."""
    seen = []
    for _ in range(windows):
        lim = ctl.limit(t)
        for i in range(ctl.cfg.min_samples):
            # Each request was admitted within this window, under the current limit.
            ctl.observe(tier, plant(lim, base, knee), t + 0.01 * i, lim, t + 0.01 * i)
        t += ctl.cfg.window_s
        ctl.update(t)
        seen.append(ctl.limit(t))
    return t, seen


def reversals(seq: list[int]) -> int:
    dirs = [b - a for a, b in zip(seq, seq[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(dirs, dirs[1:], strict=False) if (a > 0) != (b > 0))


def test_quantile_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert quantile([1.0, 5.0], 0.99) == 5.0


def test_starts_at_the_ceiling_and_holds_while_latency_is_fine() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64), 0.0)
    _, seen = run(ctl, 0.0, 20, base=0.5, knee=100)
    assert seen == [64] * 20


def test_converges_under_the_slo_from_the_ceiling() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64), 0.0)
    _, seen = run(ctl, 0.0, 30, base=0.5, knee=20)  # the SLO holds up to 40 in flight
    assert seen[0] < 64
    final = seen[-1]
    assert plant(final, 0.5, 20) <= 1.0
    assert final >= 0.8 * 40 * ctl.cfg.tolerance  # not starved far below what the SLO allows
    assert seen[-10:] == [final] * 10  # settled, not hunting


def test_step_slowdown_cuts_without_oscillating_and_recovers() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64), 0.0)
    t, before = run(ctl, 0.0, 30, base=0.5, knee=20)
    settled = before[-1]
    # Decode speed halves: latency doubles at every concurrency.
    t, during = run(ctl, t, 30, base=1.0, knee=20)
    assert during[-1] < settled
    assert plant(during[-1], 1.0, 20) <= 1.0
    assert reversals(during) == 0  # only down, never back up and down again
    assert during[-10:] == [during[-1]] * 10
    # Latency returns: the limit climbs back to where the SLO allows.
    t, after = run(ctl, t, 80, base=0.5, knee=20)
    assert reversals(after) == 0
    # It climbs into the dead band (tolerance..1 of the SLO) and stops there.
    assert ctl.cfg.tolerance <= plant(after[-1], 0.5, 20) <= 1.0
    assert after[-1] > during[-1]


def test_never_below_the_floor_even_when_latency_cannot_be_met() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, floor=4), 0.0)
    _, seen = run(ctl, 0.0, 40, base=5.0, knee=1)
    assert min(seen) == 4
    assert seen[-1] == 4


def test_recovers_from_the_floor() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, floor=2), 0.0)
    t, seen = run(ctl, 0.0, 40, base=5.0, knee=1)
    assert seen[-1] == 2
    _, seen = run(ctl, t, 200, base=0.2, knee=100)
    assert seen[-1] == 64


def test_one_window_cuts_at_most_by_min_gradient() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_gradient=0.5, min_samples=1), 0.0)
    ctl.observe("t", 100.0, 0.0, 64, 0.0)
    ctl.update(1.0)
    assert ctl.limit(1.0) == 32


def test_samples_admitted_before_a_cut_do_not_cut_again() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=2), 0.0)
    ctl.observe("t", 2.0, 0.0, 64, 0.1)
    ctl.observe("t", 2.0, 0.0, 64, 0.2)
    ctl.update(1.0)
    assert ctl.limit(1.0) == 32
    # Requests admitted before the cut finish late and slow: they describe old load.
    for i in range(10):
        ctl.observe("t", 2.0, 0.5, 64, 1.1 + i * 0.3)
    ctl.update(5.0)
    assert ctl.limit(5.0) == 32


def test_no_growth_while_the_limit_is_unused() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=1), 0.0)
    ctl.observe("t", 3.0, 0.0, 64, 0.0)
    ctl.update(1.0)
    assert ctl.limit(1.0) == 32
    for k in range(2, 20):
        ctl.observe("t", 0.1, float(k), 3, float(k))  # only 3 in flight
        ctl.update(k + 0.5)
    assert ctl.limit(30.0) == 32


def test_waits_for_min_samples() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=5), 0.0)
    for i in range(4):
        ctl.observe("t", 3.0, 0.0, 64, 2.0 + i)
    assert ctl.limit(10.0) == 64
    ctl.observe("t", 3.0, 0.0, 64, 11.0)
    assert ctl.limit(11.0) == 32


def test_at_risk_is_per_tier_and_expires() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=2, risk_hold_s=5.0), 0.0)
    for i in range(3):
        ctl.observe("premium", 1.5, 0.0, 10, 0.1 * i)
        ctl.observe("free", 0.5, 0.0, 10, 0.1 * i)
    ctl.update(1.0)
    assert ctl.at_risk("premium", 1.0) and not ctl.at_risk("free", 1.0)
    assert not ctl.at_risk("premium", 6.5)
    snap = ctl.snapshot(1.0)
    assert snap["at_risk"] == ["premium"] and snap["limit"] < 64


def test_reconfigure_keeps_the_learned_limit_within_new_bounds() -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=1), 0.0)
    ctl.observe("t", 2.0, 0.0, 64, 0.0)
    ctl.update(1.0)
    assert ctl.limit(1.0) == 32
    ctl.reconfigure(AdaptiveConfig(ceiling=16))
    assert ctl.limit(1.0) == 16
    ctl.reconfigure(AdaptiveConfig(ceiling=64))
    assert ctl.limit(1.0) == 16


@pytest.mark.parametrize("bad", [{"ceiling": 0}, {"ceiling": 4, "floor": 0}, {"ceiling": 4, "quantile": 0},
                                 {"ceiling": 4, "tolerance": 1.5}, {"ceiling": 4, "min_gradient": 1.0},
                                 {"ceiling": 4, "smoothing": 0}, {"ceiling": 4, "window_s": 0}])
def test_config_is_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveConfig(**bad)  # type: ignore[arg-type]


samples = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 50), st.floats(0, 2), st.integers(0, 200)),
                   max_size=200)


@settings(max_examples=200, deadline=None)
@given(samples, st.integers(1, 8), st.integers(8, 128))
def test_limit_always_within_floor_and_ceiling(seq: list[tuple[str, float, float, int]], floor: int,
                                               ceiling: int) -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=ceiling, floor=floor, min_samples=2), 0.0)
    t = 0.0
    for tier, ratio, dt, in_flight in seq:
        t += dt
        ctl.observe(tier, ratio, t - dt / 2, in_flight, t)
        assert floor <= ctl.limit(t) <= ceiling


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1.0001, 20), min_size=1, max_size=50))
def test_missed_slo_never_raises_the_limit(ratios: list[float]) -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=1), 0.0)
    prev = ctl.limit(0.0)
    for k, r in enumerate(ratios, 1):
        ctl.observe("t", r, float(k), 64, float(k))
        ctl.update(k + 0.5)
        cur = ctl.limit(k + 0.5)
        assert cur <= prev
        prev = cur


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 0.79), min_size=1, max_size=50), st.integers(2, 64))
def test_met_slo_never_lowers_the_limit(ratios: list[float], start: int) -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64, min_samples=1), 0.0)
    ctl.reconfigure(AdaptiveConfig(ceiling=start))
    ctl.reconfigure(AdaptiveConfig(ceiling=64, min_samples=1))
    prev = ctl.limit(0.0)
    for k, r in enumerate(ratios, 1):
        ctl.observe("t", r, float(k), 64, float(k))
        ctl.update(k + 0.5)
        cur = ctl.limit(k + 0.5)
        assert cur >= prev
        prev = cur


@settings(max_examples=100, deadline=None)
@given(st.floats(0.3, 3.0), st.integers(4, 60))
def test_settles_without_hunting_for_any_backend(base: float, knee: int) -> None:
    ctl = AdaptiveLimit(AdaptiveConfig(ceiling=64), 0.0)
    _, seen = run(ctl, 0.0, 150, base=base, knee=knee)
    tail = seen[-20:]
    assert len(set(tail)) == 1
    if tail[0] > ctl.cfg.floor:
        assert plant(tail[0], base, knee) <= 1.0
