"""KV watermark curve and controller: smoothing, fast drop, slow recovery, staleness."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.watermark import WatermarkController, scale_for

# -- the curve -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "usage,expected",
    [
        (0.0, 1.0),
        (0.70, 1.0),
        (0.775, 0.8),
        (0.85, 0.6),
        (0.99, 0.6),
        (1.5, 0.6),
        (math.nan, 0.6),
    ],
)
def test_curve_points(usage: float, expected: float) -> None:
    assert scale_for(usage) == pytest.approx(expected)


@settings(max_examples=100, deadline=None)
@given(
    u1=st.floats(0.70, 0.85),
    u2=st.floats(0.70, 0.85),
    floor=st.floats(0.0, 1.0),
)
def test_curve_is_linear_between_the_watermarks(u1: float, u2: float, floor: float) -> None:
    slope = -(1.0 - floor) / (0.85 - 0.70)
    s1, s2 = scale_for(u1, floor=floor), scale_for(u2, floor=floor)
    assert s2 - s1 == pytest.approx(slope * (u2 - u1), abs=1e-9)
    if u1 <= u2:
        assert s1 >= s2 - 1e-12  # never increases with usage
    assert floor - 1e-12 <= s1 <= 1.0


@pytest.mark.parametrize(
    "kw", [{"high": 0.7, "low": 0.7}, {"high": 0.6, "low": 0.7}, {"floor": 1.2}, {"floor": -0.1}]
)
def test_curve_rejects_bad_parameters(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        scale_for(0.5, **kw)


# -- controller ----------------------------------------------------------------------


def ctl(**kw: float) -> WatermarkController:
    return WatermarkController(**kw)


def test_no_data_means_floor_and_first_sample_sets_the_scale() -> None:
    c = ctl()
    assert c.scale(0) == 0.6
    assert c.state(0).reason == "no_data"
    c.observe(0.1, 0, now=1)
    assert c.scale(1) == 1.0  # no prior state to oscillate from: jump


def test_a_spike_drops_at_once_but_smoothing_damps_a_lone_blip() -> None:
    c = ctl()
    c.observe(0.5, 0, now=0)
    c.observe(1.0, 0, now=1)  # one bad scrape
    # EWMA(0.5) = 0.75 -> scale 0.8667: capacity drops immediately, not to floor
    assert c.scale(1) == pytest.approx(scale_for(0.75))
    assert c.scale(1) > c.floor
    c.observe(0.5, 0, now=2)  # back to normal: target 1.0, but recovery is slow
    assert c.scale(2) == pytest.approx(scale_for(0.75))
    assert c.scale(3) == pytest.approx(scale_for(0.75) + 0.05)
    assert c.scale(4) == pytest.approx(scale_for(0.75) + 0.10)
    assert c.scale(5) == 1.0  # smoothed 0.625 < low; ramp done after (1 - 0.8667) / 0.05 s


def test_sustained_saturation_reaches_floor_within_two_samples() -> None:
    c = ctl()
    c.observe(0.5, 0, now=0)
    c.observe(1.0, 0, now=1)
    c.observe(1.0, 0, now=2)  # EWMA 0.875 >= high
    assert c.scale(2) == 0.6


def test_recovery_is_rate_limited() -> None:
    c = ctl(recover_per_s=0.1)
    c.observe(0.95, 0, now=0)
    assert c.scale(0) == 0.6
    # EWMA 0.525 < low already at t=1, so the target is 1.0 from then on; the scale
    # still climbs only 0.1 per second
    seen = []
    for t in range(1, 6):
        c.observe(0.1, 0, now=t)
        seen.append(c.scale(t))
    assert seen == pytest.approx([0.6, 0.7, 0.8, 0.9, 1.0])


def test_scale_rise_does_not_depend_on_how_often_it_is_read() -> None:
    a, b = ctl(), ctl()
    for c in (a, b):
        c.observe(0.9, 0, now=0)
        c.observe(0.2, 0, now=1)
        c.observe(0.2, 0, now=2)
    for i in range(1, 30):
        a.scale(2 + i * 0.1)
    assert a.scale(5) == pytest.approx(b.scale(5))


def test_stale_metrics_count_as_saturated() -> None:
    c = ctl(stale_after_s=5)
    c.observe(0.6, 0, now=0)
    assert c.scale(5) == 1.0
    assert c.scale(5.01) == 0.6
    assert c.state(5.01).reason == "stale"
    c.observe(0.1, 0, now=6)  # back: ramps up from floor, EWMA re-seeded
    assert c.scale(6) == 0.6
    assert c.scale(7) == pytest.approx(0.65)
    assert c.state(7).smoothed_usage == 0.1  # the pre-stale 0.6 is forgotten, not averaged


def test_stale_deadline_inside_a_ramp_is_applied_even_if_read_late() -> None:
    c = ctl(stale_after_s=5)
    c.observe(0.9, 0, now=0)
    c.observe(0.1, 0, now=1)  # starts ramping
    assert c.scale(20) == 0.6  # went stale at t=6 meanwhile


@pytest.mark.parametrize("usage", [None, math.nan])
def test_unreachable_metrics_count_as_saturated(usage: float | None) -> None:
    c = ctl()
    c.observe(0.1, 0, now=0)
    c.observe(usage, None, now=1)
    assert c.scale(1) == 0.6
    assert c.state(2).reason == "unreachable"
    c.observe(0.1, 0, now=2)
    assert c.scale(2) == 0.6  # not first sample ever: ramp
    assert c.scale(3) == pytest.approx(0.65)


def test_large_waiting_queue_is_pressure() -> None:
    c = ctl(waiting_threshold=8)
    c.observe(0.1, 0, now=0)
    c.observe(0.1, 30, now=1)  # EWMA waiting 15 > 8
    assert c.scale(1) == 0.6
    assert c.state(1).reason == "queue"


def test_growing_queue_pauses_recovery_without_cutting() -> None:
    c = ctl(waiting_threshold=8)
    c.observe(0.9, 0, now=0)
    c.observe(0.2, 2, now=1)  # growing (0 -> 2) but small
    assert c.scale(1) == 0.6
    assert c.scale(2) == 0.6  # paused
    c.observe(0.2, 2, now=2)  # steady: recovery resumes
    assert c.scale(3) == pytest.approx(0.65)


def test_missing_waiting_metric_is_ignored() -> None:
    c = ctl()
    c.observe(0.1, None, now=0)
    assert c.scale(0) == 1.0


def test_time_going_backwards_does_not_raise_the_scale() -> None:
    c = ctl()
    c.observe(0.9, 0, now=10)
    c.observe(0.1, 0, now=11)
    s = c.scale(13)
    assert c.scale(5) == s
    c.observe(0.1, 0, now=4)  # treated as arriving at t=13
    assert c.scale(13) == pytest.approx(s)


@pytest.mark.parametrize(
    "kw",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"recover_per_s": 0.0},
        {"stale_after_s": 0.0},
        {"waiting_threshold": -1.0},
        {"low": 0.9},
    ],
)
def test_controller_rejects_bad_parameters(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WatermarkController(**kw)


# -- properties ----------------------------------------------------------------------

_usage = st.one_of(st.none(), st.just(math.nan), st.floats(0, 1.2))
_waiting = st.one_of(st.none(), st.floats(0, 40))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), _usage, _waiting, st.floats(0, 3)),
        st.tuples(st.just("read"), st.floats(0, 8)),
        st.tuples(st.just("back"), st.floats(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    seed_usage=st.floats(0, 1.2),
    alpha=st.floats(0.1, 1.0),
    recover=st.floats(0.01, 0.5),
    ops=_ops,
)
def test_property_bounded_slow_rise_and_stale_means_floor(
    seed_usage: float, alpha: float, recover: float, ops: list[tuple]
) -> None:
    c = WatermarkController(alpha=alpha, recover_per_s=recover, stale_after_s=5)
    now = 0.0
    c.observe(seed_usage, 0, now)
    last_obs = now
    last_usage: float | None = seed_usage
    prev_t, prev_s = now, c.scale(now)
    for op in ops:
        if op[0] == "observe":
            now += op[3]
            c.observe(op[1], op[2], now)
            last_obs = now
            last_usage = op[1]
        elif op[0] == "read":
            now += op[1]
        else:
            s_back = c.scale(now - op[1])
            assert s_back <= prev_s + recover * (now - prev_t) + 1e-9
        s = c.scale(now)
        assert c.floor <= s <= 1.0
        # never rises faster than recover_per_s (drops are free)
        assert s - prev_s <= recover * (now - prev_t) + 1e-9
        # never above what the smoothed pressure allows
        state = c.state(now)
        assert s <= state.target + 1e-12
        if now - last_obs > 5 or last_usage is None or math.isnan(last_usage):
            assert s == c.floor
        prev_t, prev_s = now, s


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(st.tuples(st.floats(0, 1), st.floats(0.1, 2)), min_size=1, max_size=20),
    reads=st.lists(st.floats(0, 1), max_size=20),
)
def test_property_reading_does_not_change_the_outcome(
    samples: list[tuple[float, float]], reads: list[float]
) -> None:
    a, b = WatermarkController(), WatermarkController()
    now = 0.0
    for i, (usage, dt) in enumerate(samples):
        # extra reads on `a` only, between the previous sample and this one
        if i < len(reads):
            a.scale(now + reads[i] * dt)
        now += dt
        for c in (a, b):
            c.observe(usage, 0, now)
    assert a.scale(now + 1) == pytest.approx(b.scale(now + 1), abs=1e-9)
