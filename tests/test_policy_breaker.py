"""The circuit breaker, driven by an explicit clock: no sleeps."""

from __future__ import annotations

import pytest

from extproc.policy.breaker import (
    REASON_HALF_OPEN_THROTTLE,
    REASON_MANUAL_OPEN,
    REASON_OPEN,
    Breaker,
    BreakerConfig,
    BreakerState,
)
from extproc.policy.breaker_outcome import Outcome, outcome_for_status

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def make(**kw: object) -> Breaker:
    base: dict[str, object] = {
        "window_s": 30.0,
        "min_requests": 20,
        "error_ratio": 0.5,
        "consecutive_failures": 5,
        "cooldown_s": 30.0,
        "max_cooldown_s": 120.0,
        "cooldown_multiplier": 2.0,
        "ramp_steps": (0.1, 0.25, 0.5, 1.0),
        "ramp_step_s": 10.0,
    }
    base.update(kw)
    return Breaker(BreakerConfig(**base), now=0.0)  # type: ignore[arg-type]


def alternate(b: Breaker, n: int, t0: float, dt: float = 0.01) -> float:
    """n outcomes alternating success/failure (never two failures in a row)."""
    t = t0
    for i in range(n):
        b.record(Outcome.FAILURE if i % 2 else Outcome.SUCCESS, 0.1, t)
        t += dt
    return t


def trip_now(b: Breaker, t: float) -> None:
    assert b.trip(t, "test")
    assert b.state(t) is OPEN


def pass_probe(b: Breaker, t: float) -> None:
    assert b.state(t) is HALF
    v = b.allow(t)
    assert v.allowed
    b.record_success(t, 0.1)


def test_defaults_are_valid_and_bad_configs_refused() -> None:
    assert Breaker().state(0.0) is CLOSED
    for bad in (
        {"error_ratio": 0.0},
        {"ramp_steps": ()},
        {"ramp_steps": (0.5, 0.2)},
        {"ramp_steps": (0.0, 1.0)},
        {"cooldown_s": 200.0},
        {"cooldown_multiplier": 0.5},
        {"min_requests": 0},
    ):
        with pytest.raises(ValueError):
            BreakerConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("status", "outcome"), [
    (200, Outcome.SUCCESS), (204, Outcome.SUCCESS), (304, Outcome.SUCCESS),
    # Every 4xx is the client's: a bad body, a missing model, a backend 429 (load the slots
    # and the watermark answer; counted, one tenant's burst would open the breaker).
    (400, Outcome.CLIENT_ERROR), (404, Outcome.CLIENT_ERROR), (408, Outcome.CLIENT_ERROR),
    (413, Outcome.CLIENT_ERROR), (422, Outcome.CLIENT_ERROR), (429, Outcome.CLIENT_ERROR),
    (499, Outcome.CLIENT_ERROR),
    # Every 5xx is the backend's (503 included: it says it cannot serve), then attributed by tenant.
    (500, Outcome.FAILURE), (502, Outcome.FAILURE), (503, Outcome.FAILURE), (504, Outcome.FAILURE),
    (599, Outcome.FAILURE),
])
def test_outcome_classification(status: int, outcome: Outcome) -> None:
    assert outcome_for_status(status) is outcome


def test_error_ratio_trips_only_after_min_requests() -> None:
    b = make()
    t = alternate(b, 19, 0.0)  # 9 failures of 19: 47 %, and under min_requests anyway
    b.record_failure(t)  # 10 of 20 = 50 %
    assert b.state(t) is OPEN
    assert b.drain_events() == [(t, CLOSED, OPEN, "error_ratio")]

    b2 = make()
    for i in range(10):  # 80 % failures, but only 10 requests and never 5 in a row
        b2.record(Outcome.FAILURE if i % 5 != 4 else Outcome.SUCCESS, None, i * 0.1)
    assert b2.state(1.0) is CLOSED


def test_error_ratio_forgets_outside_window() -> None:
    b = make()
    alternate(b, 19, 0.0)
    # 40 s later the old outcomes have left the 30 s window: one failure is not 50 % of 20.
    b.record_failure(40.0)
    assert b.state(40.0) is CLOSED
    assert b.snapshot(40.0)["window"] == {"requests": 1, "failures": 1, "slow": 0}


def test_consecutive_failures_trip() -> None:
    b = make()
    for i in range(4):
        b.record_failure(float(i))
    assert b.state(4.0) is CLOSED
    b.record_success(4.0)  # resets the run
    for i in range(4):
        b.record_failure(5.0 + i)
    assert b.state(9.0) is CLOSED
    b.record_failure(9.0)
    assert b.state(9.0) is OPEN
    assert b.snapshot(9.0)["last_cause"] == "consecutive_failures"


def test_client_errors_and_disconnects_do_not_count() -> None:
    b = make()
    for i in range(100):
        b.record(Outcome.CLIENT_ERROR, 0.1, i * 0.01)
        b.record(Outcome.CANCELLED, 99.0, i * 0.01)
        b.record(Outcome.TENANT_FAILURE, 0.1, i * 0.01)  # blamed on its tenant alone
    assert b.state(1.0) is CLOSED
    assert b.snapshot(1.0)["window"]["requests"] == 0


def test_latency_slo_trip() -> None:
    b = make(latency_slo_s=2.0, latency_breach_ratio=0.5)
    for i in range(19):
        b.record_success(i * 0.1, 5.0 if i % 2 else 0.5)  # 9 slow of 19
    assert b.state(2.0) is CLOSED
    b.record_success(2.0, 5.0)  # 10 slow of 20
    assert b.state(2.0) is OPEN
    assert b.snapshot(2.0)["last_cause"] == "latency_slo"
    # Without an SLO configured, latency alone never trips.
    b2 = make()
    for i in range(50):
        b2.record_success(i * 0.1, 100.0)
    assert b2.state(5.0) is CLOSED


def test_preemption_counter_increase_trips_but_reset_does_not() -> None:
    b = make(preemption_threshold=3.0)
    assert not b.observe_preemptions(100.0, 0.0)  # baseline
    assert not b.observe_preemptions(101.0, 1.0)
    assert not b.observe_preemptions(0.0, 2.0)  # counter reset (restart): new baseline
    assert not b.observe_preemptions(1.0, 3.0)  # +1, window total 2
    assert b.state(3.0) is CLOSED
    assert b.observe_preemptions(2.0, 4.0)  # +1, window total 3
    assert b.state(4.0) is OPEN
    assert b.snapshot(4.0)["last_cause"] == "preemption"


def test_preemption_increases_age_out_and_can_be_disabled() -> None:
    b = make(preemption_threshold=2.0)
    b.observe_preemptions(0.0, 0.0)
    b.observe_preemptions(1.0, 1.0)
    b.observe_preemptions(2.0, 60.0)  # the first increase left the window
    assert b.state(60.0) is CLOSED
    off = make(trip_on_preemption=False)
    off.observe_preemptions(0.0, 0.0)
    assert not off.observe_preemptions(1000.0, 1.0)
    assert off.state(1.0) is CLOSED


def test_preemptions_while_open_are_spent_and_half_open_rise_reopens() -> None:
    b = make(preemption_threshold=2.0)
    b.observe_preemptions(0.0, 0.0)
    assert b.observe_preemptions(5.0, 1.0)
    assert not b.observe_preemptions(9.0, 10.0)  # the tail of the batch that tripped us
    pass_probe(b, 31.0)
    assert not b.observe_preemptions(10.0, 32.0)  # +1: under the threshold
    assert b.observe_preemptions(11.0, 33.0)  # +2 within the window while ramping
    assert b.state(33.0) is OPEN
    assert b.snapshot(33.0)["cooldown_left_s"] == 60.0


def test_open_denies_with_retry_after_then_half_open_probe() -> None:
    b = make()
    trip_now(b, 100.0)
    v = b.allow(110.0)
    assert (v.allowed, v.state, v.reason) == (False, OPEN, REASON_OPEN)
    assert v.retry_after_s == pytest.approx(20.0)
    assert b.state(130.0) is HALF
    probe = b.allow(130.0)
    assert probe.allowed and probe.state is HALF
    # Only one probe in flight.
    second = b.allow(130.5)
    assert (second.allowed, second.reason) == (False, REASON_HALF_OPEN_THROTTLE)
    b.record_success(131.0, 0.2)
    assert b.snapshot(131.0)["phase"] == "ramp"
    events = b.drain_events()
    assert [(e.from_state, e.to_state, e.cause) for e in events] == [
        (CLOSED, OPEN, "test"),
        (OPEN, HALF, "cooldown_elapsed"),
    ]
    assert events[1].at == 130.0  # stamped when it fell due, not when noticed


def test_probe_needs_configured_successes_and_lost_probe_times_out() -> None:
    b = make(probe_successes=2, probe_timeout_s=5.0)
    trip_now(b, 0.0)
    assert b.allow(30.0).allowed
    assert not b.allow(31.0).allowed
    assert b.allow(35.0).allowed  # the first probe never reported: another may go
    b.record_success(36.0)
    assert b.snapshot(36.0)["phase"] == "probe"
    assert b.allow(36.0).allowed
    b.record(Outcome.CANCELLED, None, 37.0)  # a disconnect proves nothing, frees the probe
    assert b.allow(37.0).allowed
    b.record_success(38.0)
    assert b.snapshot(38.0)["phase"] == "ramp"


def test_probe_failure_reopens_with_growing_cooldown_up_to_cap() -> None:
    b = make()
    t = 0.0
    trip_now(b, t)
    cooldowns = []
    for _ in range(5):
        opened = b.snapshot(t)["since"]
        left = b.snapshot(t)["cooldown_left_s"]
        cooldowns.append(left)
        t = opened + left
        assert b.allow(t).allowed  # the probe
        b.record_failure(t)
        assert b.state(t) is OPEN
    assert cooldowns == [30.0, 60.0, 120.0, 120.0, 120.0]
    assert b.snapshot(t)["trips"] == 6


def test_ramp_admits_configured_fractions_then_closes() -> None:
    b = make()
    trip_now(b, 0.0)
    pass_probe(b, 30.0)
    allowed_per_step = []
    for step in range(4):
        start = 30.0 + step * 10.0
        calls = [b.allow(start + i * 0.05) for i in range(100)]
        assert all(v.state is HALF for v in calls)
        allowed_per_step.append(sum(v.allowed for v in calls))
        for v in calls:
            if not v.allowed:
                assert v.reason == REASON_HALF_OPEN_THROTTLE
                assert v.retry_after_s is not None and v.retry_after_s > 0
        assert b.snapshot(start)["ramp_fraction"] == (0.1, 0.25, 0.5, 1.0)[step]
        b.record_success(start + 5.0, 0.3)
    assert allowed_per_step == [10, 25, 50, 100]
    assert b.state(69.9) is HALF
    assert b.state(70.0) is CLOSED
    assert b.drain_events()[-1] == (70.0, HALF, CLOSED, "recovered")


def test_ramp_failure_reopens_with_longer_cooldown() -> None:
    b = make()
    trip_now(b, 0.0)
    pass_probe(b, 30.0)
    assert b.state(45.0) is HALF
    b.record_failure(45.0)
    assert b.state(45.0) is OPEN
    assert b.snapshot(45.0)["cooldown_left_s"] == 60.0


def test_ramp_step_with_slow_responses_reopens() -> None:
    b = make(latency_slo_s=1.0, latency_breach_ratio=0.5)
    trip_now(b, 0.0)
    b.allow(30.0)
    b.record_success(30.0, 3.0)  # a slow probe fails the probe
    assert b.state(30.0) is OPEN
    pass_probe(b, 90.0)
    b.record_success(91.0, 0.2)
    b.record_success(92.0, 5.0)  # one slow of two in step 0
    assert b.state(100.0) is OPEN
    assert b.snapshot(100.0)["last_cause"] == "latency_slo"


def test_idle_ramp_steps_up_on_time_alone() -> None:
    b = make()
    trip_now(b, 0.0)
    pass_probe(b, 30.0)
    assert b.state(500.0) is CLOSED
    causes = [e.cause for e in b.drain_events()]
    assert causes == ["test", "cooldown_elapsed", "recovered"]


def test_cooldown_growth_resets_after_healthy_period() -> None:
    b = make(cooldown_reset_s=300.0)
    trip_now(b, 0.0)
    pass_probe(b, 30.0)
    assert b.state(70.0) is CLOSED
    # A relapse soon after recovery waits longer ...
    trip_now(b, 100.0)
    assert b.snapshot(100.0)["cooldown_left_s"] == 60.0
    pass_probe(b, 160.0)
    assert b.state(200.0) is CLOSED
    # ... but after five healthy minutes the cooldown is back at its base.
    assert b.snapshot(499.0)["trip_level"] == 2
    assert b.snapshot(500.0)["trip_level"] == 0
    trip_now(b, 510.0)
    assert b.snapshot(510.0)["cooldown_left_s"] == 30.0


def test_outcomes_while_open_are_ignored() -> None:
    b = make()
    trip_now(b, 0.0)
    for i in range(10):
        b.record_success(float(i))  # stragglers from before the trip
    assert b.state(10.0) is OPEN
    assert b.snapshot(10.0)["cooldown_left_s"] == 20.0


def test_manual_open_overrides_healthy_breaker_then_expiry_resumes_half_open() -> None:
    b = make()
    b.set_manual("open", "maintenance", until=60.0, now=10.0)
    v = b.allow(20.0)
    assert (v.allowed, v.state, v.reason) == (False, OPEN, REASON_MANUAL_OPEN)
    assert v.retry_after_s == pytest.approx(40.0)
    snap = b.snapshot(20.0)
    assert snap["manual"]["reason"] == "maintenance" and snap["automatic_state"] == "closed"
    # Failures during the override trip nothing.
    for i in range(30):
        b.record_failure(20.0 + i * 0.1)
    assert b.state(59.0) is OPEN
    assert b.state(60.0) is HALF  # expired: probe, then ramp
    assert b.snapshot(60.0)["manual"] is None
    assert [(e.to_state, e.cause) for e in b.drain_events()] == [
        (OPEN, "manual_open"),
        (HALF, "manual_expired"),
    ]
    assert b.snapshot(60.0)["trips"] == 0


def test_manual_closed_overrides_open_breaker() -> None:
    b = make()
    trip_now(b, 0.0)
    b.set_manual("closed", "false alarm", until=None, now=5.0)
    assert b.allow(6.0).allowed and b.state(6.0) is CLOSED
    assert b.state(1000.0) is CLOSED  # no expiry until cleared
    for i in range(10):
        b.record_success(1000.0 + i)
    b.set_manual(None, "", None, now=1010.0)
    assert b.state(1010.0) is CLOSED
    assert b.drain_events()[-1] == (1010.0, CLOSED, CLOSED, "manual_cleared")
    # Automatic again: failures trip it.
    for i in range(5):
        b.record_failure(1011.0 + i)
    assert b.state(1016.0) is OPEN


def test_manual_closed_expiry_trips_at_once_if_backend_kept_failing() -> None:
    b = make()
    b.set_manual("closed", "override", until=20.0, now=0.0)
    alternate(b, 40, 1.0, dt=0.1)  # 50 % failures while forced closed
    assert b.state(19.0) is CLOSED
    assert b.state(20.0) is OPEN
    assert [e.cause for e in b.drain_events()] == [
        "manual_closed",
        "manual_expired",
        "error_ratio",
    ]


def test_manual_override_validation_and_trip_while_manual() -> None:
    b = make()
    with pytest.raises(ValueError):
        b.set_manual("open", "past", until=5.0, now=10.0)
    with pytest.raises(ValueError):
        b.set_manual("half_open", "x", until=None, now=10.0)  # type: ignore[arg-type]
    b.set_manual("closed", "x", until=None, now=10.0)
    assert not b.trip(11.0)
    assert b.state(11.0) is CLOSED
    b.set_manual(None, "", None, 12.0)
    assert b.trip(13.0, "backend_oom")
    assert not b.trip(14.0)  # already open
    assert b.snapshot(14.0)["last_cause"] == "backend_oom"


def test_clock_going_backwards_is_clamped() -> None:
    b = make()
    trip_now(b, 100.0)
    assert b.allow(50.0).retry_after_s == pytest.approx(30.0)


def test_snapshot_shape() -> None:
    b = make()
    snap = b.snapshot(0.0)
    assert snap["state"] == "closed"
    assert snap["ramp_fraction"] == 1.0
    assert snap["cooldown_left_s"] == 0.0
    assert snap["manual"] is None
    assert snap["trips"] == 0
    assert snap["next_cooldown_s"] == 30.0
