"""A manual breaker override of one pool endpoint: parsed, validated, applied on reload."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from extproc.backends.hold import Hold
from extproc.backends.pool_report import pool_status
from extproc.backends.state import BackendState
from extproc.policy.breaker import BreakerState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.schema import PolicyError, build_policy
from extproc.runtime.runtime import Runtime
from extproc.service.monitor import refresh
from tests.backend_ops import try_acquire
from tests.test_pool import TWO, doc

A, B = "127.0.0.1:7001", "127.0.0.1:7002"


def with_breakers(*entries: dict[str, Any]) -> dict[str, Any]:
    d = doc(TWO)
    d["breakers"] = list(entries)
    return d


def test_an_endpoint_override_parses() -> None:
    p = build_policy(with_breakers({"backend": "pool", "endpoint": B, "state": "open", "reason": "bad GPU",
                                    "until": 2e9, "by": "ops", "at": 1.0}))
    ov = p.breakers[0]
    assert (ov.backend, ov.endpoint, ov.state, ov.reason, ov.until, ov.model) == \
        ("pool", B, "open", "bad GPU", 2e9, None)


@pytest.mark.parametrize(
    "entry,needle",
    [
        (
            {"endpoint": "127.0.0.1:9999"},
            "has no endpoint '127.0.0.1:9999' (its endpoints: 127.0.0.1:7001, 127.0.0.1:7002)",
        ),
        ({"endpoint": B, "model": "m"}, "a model route or a pool endpoint, not both"),
        ({"endpoint": 7002}, "breakers[0].endpoint"),
    ],
)
def test_a_bad_endpoint_override_is_refused_with_a_clear_error(entry: dict[str, Any], needle: str) -> None:
    with pytest.raises(PolicyError) as exc:
        build_policy(with_breakers({"backend": "pool", "state": "open", "reason": "x", **entry}))
    assert needle in str(exc.value)


def test_an_endpoint_override_on_a_single_address_backend_is_refused() -> None:
    d = doc(TWO)
    del d["backends"][0]["endpoints"]
    d["backends"][0]["address"] = A
    d["breakers"] = [{"backend": "pool", "endpoint": A, "state": "open", "reason": "x"}]
    with pytest.raises(PolicyError) as exc:
        build_policy(d)
    assert "backend 'pool' is not a pool" in str(exc.value)


def runtime(*entries: dict[str, Any]) -> BackendState:
    p = build_policy(with_breakers(*entries))
    return BackendState.create(p.backends[0], p, 0.0)


def reload(be: BackendState, *entries: dict[str, Any], now: float, wall: float | None = None) -> None:
    p = build_policy(with_breakers(*entries))
    if wall is None:
        be.reconfigure(p.backends[0], p, now)
    else:
        be.apply_override(p, now, wall)


def test_a_tripped_endpoint_gets_no_requests_and_a_reset_brings_it_back() -> None:
    trip = {"backend": "pool", "endpoint": B, "state": "open", "reason": "bad GPU"}
    be = runtime(trip)
    assert be.endpoints is not None
    # B has the most room and would be picked first; tripped, everything goes to A.
    assert be.endpoints.by_key[B].breaker.state(0.0) is BreakerState.OPEN
    assert be.breaker.state(0.0) is BreakerState.CLOSED  # the pool's breaker is untouched
    held = [try_acquire(be, "t", "a", None, 100, 0.0) for _ in range(3)]
    assert all(isinstance(h, Hold) and h.endpoint == A for h in held)
    status = {e["address"]: e for e in pool_status(be.endpoints, 0.0) or []}
    assert status[B]["usable"] is False and status[B]["breaker"]["manual"]["reason"] == "bad GPU"
    for h in held:
        assert isinstance(h, Hold)
        be.release(h, 0.0)

    # Reset (forced closed): B is picked again.
    reload(be, {**trip, "state": "closed", "reason": "GPU swapped"}, now=1.0)
    assert be.endpoints.by_key[B].breaker.state(1.0) is BreakerState.CLOSED
    got = try_acquire(be, "t", "a", None, 100, 1.0)
    assert isinstance(got, Hold) and got.endpoint == B
    be.release(got, 1.0)
    # Cleared (the entry leaves the policy): automatic again, half-open after a manual
    # open (nobody has seen it healthy since), and still picked.
    reload(be, now=2.0)
    assert be.endpoints.by_key[B].breaker.snapshot(2.0)["manual"] is None
    got = try_acquire(be, "t", "a", None, 100, 2.0)
    assert isinstance(got, Hold) and got.endpoint == B
    be.release(got, 2.0)


def test_a_forced_closed_endpoint_ignores_failures_until_cleared() -> None:
    be = runtime({"backend": "pool", "endpoint": A, "state": "closed", "reason": "known flaky, keep it"})
    assert be.endpoints is not None
    for i in range(20):
        be.endpoints.record(A, Outcome.FAILURE, 0.1, float(i) / 10)
    assert be.endpoints.by_key[A].breaker.state(2.0) is BreakerState.CLOSED
    assert be.endpoints.by_key[A].usable(2.0)


def test_an_endpoint_override_expires_by_its_until() -> None:
    wall0 = 1_000_000.0
    trip = {"backend": "pool", "endpoint": A, "state": "open", "reason": "r", "until": wall0 + 30}
    be = runtime()
    reload(be, trip, now=10.0, wall=wall0)  # 30 s of wall clock left: open until now + 30
    assert be.endpoints is not None
    st = be.endpoints.by_key[A]
    assert st.breaker.state(39.0) is BreakerState.OPEN
    # After a manual open the automatic breaker resumes half-open (it has not seen A healthy).
    assert st.breaker.state(41.0) is BreakerState.HALF_OPEN and st.breaker.snapshot(41.0)["manual"] is None


def test_an_expired_endpoint_override_is_not_applied() -> None:
    wall0 = 1_000_000.0
    be = runtime()
    reload(be, {"backend": "pool", "endpoint": A, "state": "open", "reason": "r", "until": wall0 - 1},
           now=5.0, wall=wall0)
    assert be.endpoints is not None
    assert be.endpoints.by_key[A].breaker.state(5.0) is BreakerState.CLOSED


def test_backend_and_endpoint_overrides_are_independent() -> None:
    be = runtime({"backend": "pool", "endpoint": A, "state": "open", "reason": "ep"},
                 {"backend": "pool", "state": "closed", "reason": "pool"})
    assert be.endpoints is not None
    assert be.override is not None and be.override.reason == "pool"
    assert be.endpoints.by_key[A].breaker.state(0.0) is BreakerState.OPEN
    assert be.endpoints.by_key[B].breaker.state(0.0) is BreakerState.CLOSED
    # Dropping the backend's entry leaves the endpoint's trip alone.
    reload(be, {"backend": "pool", "endpoint": A, "state": "open", "reason": "ep"}, now=1.0)
    assert be.override is None
    assert be.endpoints.by_key[A].breaker.state(1.0) is BreakerState.OPEN


def test_a_rebuilt_endpoint_breaker_keeps_the_manual_trip() -> None:
    trip = {"backend": "pool", "endpoint": A, "state": "open", "reason": "ep"}
    be = runtime(trip)
    d = with_breakers(trip)
    d["backends"][0]["breaker"] = {"cooldown_s": 5}
    p = build_policy(d)
    be.reconfigure(p.backends[0], p, 1.0)
    assert be.endpoints is not None
    assert be.endpoints.by_key[A].breaker.config.cooldown_s == 5
    assert be.endpoints.by_key[A].breaker.state(1.0) is BreakerState.OPEN


def test_an_endpoint_trip_is_a_breaker_transition_on_the_replica(caplog: pytest.LogCaptureFixture) -> None:
    rt = Runtime(build_policy(with_breakers({"backend": "pool", "endpoint": B, "state": "open",
                                             "reason": "bad GPU"})))
    with caplog.at_level(logging.WARNING, logger="sluice.monitor"):
        refresh(rt)
    assert rt.metrics.registry.get_sample_value("sluice_breaker_transitions_total", {
        "backend": f"pool@{B}", "from_state": "closed", "to_state": "open", "cause": "manual_open"}) == 1.0
    assert any(f"endpoint breaker pool@{B}: closed -> open (manual_open)" in r.getMessage() for r in caplog.records)


def test_an_expired_backend_override_in_the_files_does_not_break_the_load() -> None:
    """Before, ``Breaker.set_manual`` raised for an ``until`` in the past and the replica
    could not load the policy; an expired entry is now simply not applied."""
    be = runtime({"backend": "pool", "state": "open", "reason": "old", "until": 1.0},
                 {"backend": "pool", "endpoint": A, "state": "open", "reason": "old", "until": 1.0})
    assert be.endpoints is not None
    assert be.breaker.state(0.0) is BreakerState.CLOSED
    assert be.endpoints.by_key[A].breaker.state(0.0) is BreakerState.CLOSED
