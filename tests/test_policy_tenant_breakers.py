"""Failure attribution: who a backend failure is blamed on, and the tenant breakers it trips.

Pure: time is passed in, nothing sleeps.
"""

from __future__ import annotations

import pytest

from extproc.policy.breaker import Breaker, BreakerConfig, BreakerState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.tenant_breakers import TenantBreakers

OK, FAIL, CLIENT, GONE = Outcome.SUCCESS, Outcome.FAILURE, Outcome.CLIENT_ERROR, Outcome.CANCELLED
CFG = BreakerConfig(window_s=30, consecutive_failures=3, min_requests=100, cooldown_s=10, max_cooldown_s=40,
                    ramp_steps=(1.0,), ramp_step_s=0)


def tb(min_failing: int = 2, max_tenants: int = 100, cfg: BreakerConfig = CFG) -> TenantBreakers:
    return TenantBreakers(cfg, min_failing, max_tenants, now=0.0)


# (case, history of (tenant, outcome, at), the tenant that fails at t=40, min_failing_tenants, blamed on)
BLAME_CASES = [
    # Alone, a failure proves nothing: it is the tenant's until Sluice's own probe fails too.
    ("lone tenant, nothing known", [], "t", 2, "tenant"),
    ("lone tenant failing again and again", [("t", FAIL, 38), ("t", FAIL, 39)], "t", 2, "tenant"),
    ("its own successes vouch for nothing", [("t", OK, 39)], "t", 2, "tenant"),
    ("lone, and Sluice's probe failed", [("probe", FAIL, 35)], "t", 2, "backend"),
    ("lone, and Sluice's probe passed", [("probe", OK, 35)], "t", 2, "tenant"),
    ("lone, Sluice's failed probe is older than the window", [("probe", FAIL, 5)], "t", 2,
     "tenant"),
    ("another succeeding outweighs a failed probe", [("probe", FAIL, 35), ("u", OK, 39)], "t", 2,
     "tenant"),
    ("fails while another succeeds", [("u", OK, 39)], "t", 2, "tenant"),
    ("fails repeatedly while another succeeds", [("u", OK, 20), ("t", FAIL, 38), ("t", FAIL, 39)], "t", 2,
     "tenant"),
    ("a second tenant failing makes it the backend's", [("u", OK, 35), ("v", FAIL, 39)], "t", 2, "backend"),
    ("every other tenant failing", [("u", OK, 10), ("u", FAIL, 39)], "t", 2, "backend"),
    ("a recovered tenant vouches again", [("u", FAIL, 20), ("u", OK, 39)], "t", 2, "tenant"),
    ("a success older than the window vouches for nothing", [("u", OK, 9)], "t", 2, "tenant"),
    ("... nor does a failed probe", [("u", OK, 9), ("probe", FAIL, 39)], "t", 2, "backend"),
    ("a failure older than the window is forgotten", [("v", FAIL, 9), ("u", OK, 39)], "t", 2, "tenant"),
    ("client errors and cancels say nothing", [("u", OK, 30), ("u", CLIENT, 38), ("u", GONE, 39),
                                               ("v", CLIENT, 39)], "t", 2, "tenant"),
    ("min_failing_tenants 1: always the backend", [("u", OK, 39)], "t", 1, "backend"),
    ("min_failing_tenants 3: two failing is still the tenant", [("u", OK, 39), ("v", FAIL, 39)], "t", 3,
     "tenant"),
    ("min_failing_tenants 3: three failing is the backend", [("u", OK, 39), ("v", FAIL, 39), ("w", FAIL, 39)],
     "t", 3, "backend"),
]


@pytest.mark.parametrize(("history", "tenant", "min_failing", "blamed"),
                         [c[1:] for c in BLAME_CASES], ids=[c[0] for c in BLAME_CASES])
def test_who_a_failure_is_blamed_on(history: list[tuple[str, Outcome, float]], tenant: str, min_failing: int,
                                    blamed: str) -> None:
    t = tb(min_failing)
    for who, outcome, at in history:
        if who == "probe":
            t.probed(outcome is FAIL, at)
        else:
            t.record(who, outcome, at)
    assert t.backend_to_blame(tenant, 40.0) is (blamed == "backend")
    # record() agrees with the query and tells the backend's breakers what to count.
    expected = Outcome.FAILURE if blamed == "backend" else Outcome.TENANT_FAILURE
    assert t.record(tenant, FAIL, 40.0) is expected


def test_successes_and_non_failures_pass_through_unchanged() -> None:
    t = tb()
    for outcome in (OK, CLIENT, GONE):
        assert t.record("t", outcome, 1.0) is outcome


def test_one_tenants_failures_trip_its_own_breaker_only() -> None:
    t = tb()
    t.record("good", OK, 0.0)
    for i in range(3):
        assert t.allow("bad", 1.0 + i).allowed
        assert t.record("bad", FAIL, 1.5 + i) is Outcome.TENANT_FAILURE
        t.record("good", OK, 1.6 + i)
    v = t.allow("bad", 4.0)
    assert not v.allowed and v.state is BreakerState.OPEN and v.reason == "breaker_open"
    assert v.retry_after_s == pytest.approx(10 - (4.0 - 3.5))
    assert t.allow("good", 4.0).allowed and t.allow("someone-else", 4.0).allowed
    snap = t.snapshot(4.0)
    assert snap["tripped"] == {"bad": {"state": "open", "retry_after_s": pytest.approx(9.5), "trips": 1,
                                       "last_cause": "consecutive_failures"}}
    assert snap["breakers"] == 1 and snap["by_state"] == {"open": 1}
    events = t.drain_events()
    assert [(who, str(ev.to_state), ev.cause) for who, ev in events] == [("bad", "open", "consecutive_failures")]
    assert t.drain_events() == []


def test_the_backend_breaker_ignores_a_failure_blamed_on_a_tenant() -> None:
    shared = Breaker(BreakerConfig(consecutive_failures=2), now=0.0)
    t = tb()
    t.record("good", OK, 0.0)
    shared.record(OK, None, 0.0)
    for i in range(6):  # one free-key tenant's six 500s
        shared.record(t.record("free", FAIL, 1.0 + i), None, 1.0 + i)
    assert shared.state(7.0) is BreakerState.CLOSED
    assert shared.snapshot(7.0)["window"] == {"requests": 1, "failures": 0, "slow": 0}


def test_a_backend_failing_for_everyone_trips_the_backend_breaker_not_the_tenants() -> None:
    shared = Breaker(BreakerConfig(consecutive_failures=3), now=0.0)
    t = tb()
    for who in ("a", "b", "c"):
        t.record(who, OK, 0.0)
    blamed = []
    for i, who in enumerate(["a", "b", "c", "a", "b"]):
        out = t.record(who, FAIL, 1.0 + i)
        blamed.append(out)
        shared.record(out, None, 1.0 + i)
    # The first failure could be a's alone (b and c were fine); from the second tenant on, the backend's.
    assert blamed == [Outcome.TENANT_FAILURE, Outcome.FAILURE, Outcome.FAILURE, Outcome.FAILURE, Outcome.FAILURE]
    assert shared.state(6.0) is BreakerState.OPEN
    assert all(t.allow(who, 6.0).allowed for who in "abc"), "no tenant is refused for the backend's failures"


def test_a_failure_blamed_on_the_backend_gives_a_tenant_probe_its_place_back() -> None:
    t = tb()
    t.record("good", OK, 0.0)
    for i in range(3):
        t.record("bad", FAIL, 1.0 + i)
        t.record("good", OK, 1.1 + i)
    assert not t.allow("bad", 5.0).allowed
    probe = t.allow("bad", 14.0)  # cooldown over: one probe
    assert probe.allowed and probe.state is BreakerState.HALF_OPEN
    assert not t.allow("bad", 14.1).allowed, "one probe at a time"
    t.record("other", FAIL, 14.2)  # now two tenants fail: the probe's failure is the backend's
    assert t.record("bad", FAIL, 14.3) is Outcome.FAILURE
    assert t.allow("bad", 14.4).allowed, "the probe proved nothing about the tenant: another may go"


def test_a_failing_probe_reopens_and_a_good_one_closes() -> None:
    t = tb()
    t.record("good", OK, 0.0)
    for i in range(3):
        t.record("bad", FAIL, 1.0 + i)
    t.record("good", OK, 3.5)
    assert t.allow("bad", 13.5).allowed
    assert t.record("bad", FAIL, 13.6) is Outcome.TENANT_FAILURE
    v = t.allow("bad", 14.0)
    assert not v.allowed and v.retry_after_s == pytest.approx(20 - 0.4), "the cooldown doubles"
    t.record("good", OK, 30.0)
    assert t.allow("bad", 34.0).allowed
    t.record("bad", OK, 34.1)
    assert t.allow("bad", 34.2).allowed and t.snapshot(34.2)["tripped"] == {}


def test_closed_idle_tenant_breakers_are_dropped_open_ones_kept() -> None:
    t = tb(min_failing=3)
    t.record("good", OK, 0.0)
    t.record("flaky", FAIL, 1.0)  # one blamed failure: a breaker, still closed
    for i in range(3):
        t.record("bad", FAIL, 1.0 + i)
    assert len(t) == 2
    assert t.snapshot(20.0)["breakers"] == 2
    # 30 s without an outcome: flaky's closed breaker goes; bad's is still open (cooldown 10 s, then
    # half-open: it goes too once idle, with no probe pending).
    t.record("good", OK, 25.0)
    assert len(t) == 2
    snap = t.snapshot(31.5)
    assert snap["breakers"] == 1 and "bad" in snap["tripped"]
    assert len(t) == 1
    t.snapshot(33.5)
    assert len(t) == 0 and t.snapshot(33.5)["tracked_tenants"] == 1  # good's success of t=25
    # The events of a dropped breaker are not lost.
    assert [(who, str(ev.to_state)) for who, ev in t.drain_events()] == [("bad", "open"), ("bad", "half_open")]


def test_an_open_breaker_outlives_the_window_until_its_cooldown_ends() -> None:
    cfg = BreakerConfig(window_s=5, consecutive_failures=1, cooldown_s=60, max_cooldown_s=60)
    t = tb(cfg=cfg)
    t.record("good", OK, 0.0)
    t.record("bad", FAIL, 1.0)
    assert not t.allow("bad", 50.0).allowed, "forgotten outcomes, but the breaker holds"
    assert t.allow("bad", 62.0).allowed


def test_a_flood_of_tenants_cannot_grow_memory() -> None:
    # Each failure blamed on its own tenant (min_failing_tenants huge): a breaker each, up to the cap.
    t = tb(min_failing=10**6, max_tenants=50)
    now = 1.0
    blamed = 0
    for i in range(5000):
        now += 0.001
        t.record("good", OK, now)
        blamed += t.record(f"k{i}", FAIL, now) is Outcome.TENANT_FAILURE
        t.allow(f"k{i}", now)
        assert len(t) <= 50 and t.snapshot(now)["tracked_tenants"] <= 50
    assert len(t) == 50 and blamed == 5000, "idle closed breakers made room for new ones"


def test_when_every_breaker_place_is_held_open_a_new_failure_is_the_backends() -> None:
    cfg = BreakerConfig(window_s=30, consecutive_failures=1, cooldown_s=100, max_cooldown_s=100)
    # min_failing_tenants 10, so that three failing tenants are still each to blame.
    t = TenantBreakers(cfg, 10, 3, now=0.0)
    t.record("good", OK, 0.0)
    for i, who in enumerate(("a", "b", "c")):
        assert t.record(who, FAIL, 1.0 + i) is Outcome.TENANT_FAILURE
        t.record("good", OK, 1.5 + i)
    assert len(t) == 3 and not any(t.allow(w, 5.0).allowed for w in "abc")
    assert t.record("d", FAIL, 5.0) is Outcome.FAILURE
    assert t.allow("d", 5.1).allowed and len(t) == 3


def test_the_clock_going_backwards_is_clamped() -> None:
    t = tb()
    t.record("u", OK, 100.0)
    assert not t.backend_to_blame("t", 50.0)  # read as t=100: u's success is fresh


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_failing_tenants"):
        TenantBreakers(CFG, 0, 10)
    with pytest.raises(ValueError, match="max_tenant_breakers"):
        TenantBreakers(CFG, 2, 0)


def test_a_lone_failure_asks_for_one_probe_of_sluices_own_at_a_time() -> None:
    t = tb()
    assert not t.probe_wanted(0.0)
    assert t.record("t", FAIL, 1.0) is Outcome.TENANT_FAILURE
    assert t.probe_wanted(1.0)
    t.probed(False, 1.5)  # the backend answered Sluice: the failure stays the tenant's
    assert not t.probe_wanted(1.5)
    t.record("t", FAIL, 2.0)
    assert not t.probe_wanted(2.0), "not again before own_probe_after_s"
    assert t.probe_wanted(6.5)
    t.probed(True, 6.5)
    assert t.record("t", FAIL, 7.0) is Outcome.FAILURE  # confirmed: the backend's for the window
    assert not t.probe_wanted(8.0)
    assert t.record("t", FAIL, 37.0) is Outcome.TENANT_FAILURE  # the verdict went stale
    # A failure others can vouch against never asks for one.
    u = tb()
    u.record("v", OK, 1.0)
    u.record("t", FAIL, 2.0)
    assert not u.probe_wanted(2.0)


def test_without_probes_a_lone_tenants_failure_is_the_backends_as_before() -> None:
    cfg = BreakerConfig(window_s=30, consecutive_failures=3, min_requests=100, cooldown_s=10,
                        max_cooldown_s=40, own_probe_after_s=0)
    t = tb(cfg=cfg)
    assert t.record("t", FAIL, 1.0) is Outcome.FAILURE and not t.probe_wanted(1.0)
