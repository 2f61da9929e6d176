"""The state seam: TPM and RPM charged together, settle, ledger and reconfiguration.

Runs against every implementation: LocalState, and RedisState on a real redis-server.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.policy.schema import Limits
from extproc.policy.state import STATE_IMPLEMENTATIONS, TokenState
from tests.redis_server import redis_server_fixture, redis_state_factory_fixture  # noqa: F401 - fixtures

# Every implementation of the state seam passes the same suite: the in-process ones,
# and the Redis one (it does I/O, so extproc.policy cannot list it).
LOCAL = {c.__name__: c for c in STATE_IMPLEMENTATIONS}


@pytest.fixture(params=[*LOCAL, "RedisState"])
def make_state(request: pytest.FixtureRequest) -> Callable[[], TokenState]:
    if request.param == "RedisState":
        return request.getfixturevalue("redis_state_factory")  # type: ignore[no-any-return]
    return LOCAL[request.param]

# 600 tokens/min = 10 tokens/s, 60 requests/min = 1 request/s.
LIM = Limits(tpm=600, rpm=60, burst_tokens=600, max_concurrency=10)


def test_admit_charges_both_buckets(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    v = s.admit("a", LIM, 100, now=0.0)
    assert v.admitted and v.reason is None and v.retry_after_s == 0
    assert (v.tokens.remaining, v.requests.remaining) == (500, 59)
    assert (v.tokens.limit, v.requests.limit) == (600, 60)
    assert s.in_flight == 1
    assert s.ledger.precharged == 100 and s.ledger.outstanding == 100


def test_refused_for_tokens_does_not_use_a_request(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    assert s.admit("a", LIM, 550, now=0.0).admitted
    v = s.admit("a", LIM, 100, now=0.0)
    assert not v.admitted and v.reason == "tpm"
    assert v.requests.remaining == 59  # unchanged by the refusal
    tokens, requests = s.view("a", LIM, now=0.0)
    assert (tokens.remaining, requests.remaining) == (50, 59)
    assert s.in_flight == 1 and s.ledger.precharged == 550


def test_refused_for_requests_does_not_use_tokens(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    lim = Limits(tpm=600, rpm=2, burst_tokens=600, max_concurrency=10)
    assert s.admit("a", lim, 10, now=0.0).admitted
    assert s.admit("a", lim, 10, now=0.0).admitted
    v = s.admit("a", lim, 10, now=0.0)
    assert not v.admitted and v.reason == "rpm"
    assert v.tokens.remaining == 580
    assert math.isclose(v.retry_after_s, 30.0)  # 1 request at 2/min
    assert s.ledger.precharged == 20


def test_tpm_request_too_large(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    v = s.admit("a", LIM, 601, now=0.0)
    assert not v.admitted and v.reason == "tpm_request_too_large"
    assert v.retry_after_s == math.inf
    assert "601" in v.message and "600" in v.message
    assert v.tokens.remaining == 600 and v.requests.remaining == 60
    assert s.in_flight == 0 and s.ledger.precharged == 0
    assert s.admit("a", LIM, 600, now=0.0).admitted  # exactly the capacity fits


def test_tpm_retry_after_is_deficit_over_rate(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    assert s.admit("a", LIM, 400, now=0.0).admitted
    v = s.admit("a", LIM, 350, now=0.0)
    assert v.reason == "tpm"
    assert math.isclose(v.retry_after_s, (350 - 200) / 10.0)
    # ... and after that long it is admitted
    assert not s.admit("a", LIM, 350, now=v.retry_after_s - 0.01).admitted
    assert s.admit("a", LIM, 350, now=v.retry_after_s).admitted


def test_refund_raises_remaining(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    s.admit("a", LIM, 300, now=0.0)
    s.settle("a", reserved=300, actual=120, now=0.0)
    tokens, _ = s.view("a", LIM, now=0.0)
    assert tokens.remaining == 600 - 120
    assert s.in_flight == 0
    assert (s.ledger.charged, s.ledger.refunded, s.ledger.excess) == (120, 180, 0)
    assert s.ledger.balanced()


def test_excess_puts_the_bucket_in_debt(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    s.admit("a", LIM, 500, now=0.0)
    s.settle("a", reserved=500, actual=1000, now=0.0)
    tokens, _ = s.view("a", LIM, now=0.0)
    assert tokens.remaining == 0  # reported as 0, not negative
    v = s.admit("a", LIM, 1, now=0.0)
    assert not v.admitted and v.reason == "tpm"
    assert math.isclose(v.retry_after_s, (1 + 400) / 10.0)  # the debt is repaid first
    assert s.ledger.excess == 500 and s.ledger.balanced()


def test_settle_of_forgotten_tenant_only_touches_the_ledger(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    s.admit("a", LIM, 50, now=0.0)
    s.forget(set())
    s.settle("a", 50, 10, now=1.0)
    assert s.in_flight == 0 and s.ledger.outstanding == 0 and s.ledger.balanced()
    assert "a" not in s.snapshot(1.0)["buckets"]  # type: ignore[operator]


def test_tenants_are_independent(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    assert s.admit("a", LIM, 600, now=0.0).admitted
    assert s.admit("b", LIM, 600, now=0.0).admitted
    assert not s.admit("a", LIM, 1, now=0.0).admitted


def test_reconfigure_keeps_the_level(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    s.admit("a", LIM, 400, now=0.0)
    bigger = Limits(tpm=6000, rpm=600, burst_tokens=6000, max_concurrency=10)
    tokens, requests = s.view("a", bigger, now=0.0)
    assert tokens.remaining == 200 and tokens.limit == 6000  # no free refill
    assert requests.remaining == 59
    # the new rate applies from now on: 100 tokens/s
    tokens, _ = s.view("a", bigger, now=1.0)
    assert tokens.remaining == 300
    smaller = Limits(tpm=60, rpm=6, burst_tokens=60, max_concurrency=1)
    tokens, requests = s.view("a", smaller, now=1.0)
    assert tokens.remaining == 60 and requests.remaining == 6  # clamped to the new capacity


def test_scale_keeps_headroom_and_slows_refill(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    # At scale 0.5 the top half of the 600-token bucket is out of reach.
    assert s.admit("a", LIM, 300, now=0.0, scale=0.5).admitted
    v = s.admit("a", LIM, 1, now=0.0, scale=0.5)
    assert not v.admitted and v.reason == "tpm"
    assert v.retry_after_s > 0
    # Back at full scale the saved tokens are still there: nothing was destroyed.
    tokens, _ = s.view("a", LIM, now=0.0)
    assert tokens.remaining == 300
    assert s.admit("a", LIM, 300, now=0.0, scale=1.0).admitted


def test_scale_slows_the_refill_rate(make_state: Callable[[], TokenState]) -> None:
    full, half = make_state(), make_state()
    assert full.admit("a", LIM, 600, now=0.0, scale=1.0).admitted
    # A request may still use the whole bucket once it is full, even under pressure.
    assert half.admit("a", LIM, 600, now=0.0, scale=0.5).admitted
    # 10 s later: the full-scale bucket refilled 100 tokens, the half-scale one 50.
    assert full.view("a", LIM, 10.0)[0].remaining == 100
    assert half.view("a", LIM, 10.0)[0].remaining == 50


def test_snapshot(make_state: Callable[[], TokenState]) -> None:
    s = make_state()
    s.admit("a", LIM, 100, now=0.0)
    snap = s.snapshot(0.0)
    assert snap["in_flight"] == 1
    assert snap["ledger"]["outstanding"] == 100  # type: ignore[index]
    assert snap["buckets"]["a"] == {"tokens": 500, "requests": 59}  # type: ignore[index]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from("abc"), st.integers(0, 800), st.floats(0, 5)),
        st.tuples(st.just("settle"), st.integers(0, 50), st.integers(0, 1500), st.floats(0, 5)),
        st.tuples(st.just("limits"), st.sampled_from("abc"), st.integers(1, 2000), st.floats(0, 5)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_ledger_balanced_after_any_sequence(
    make_state: Callable[[], TokenState], seq: list[tuple[str, object, int, float]]
) -> None:
    s = make_state()
    limits = dict.fromkeys("abc", LIM)
    held: list[tuple[str, int]] = []
    now = 0.0
    for op, who, n, dt in seq:
        now += dt
        if op == "admit":
            assert isinstance(who, str)
            v = s.admit(who, limits[who], n, now)
            if v.admitted:
                held.append((who, n))
            assert v.tokens.remaining >= 0 and v.requests.remaining >= 0
        elif op == "settle" and held:
            assert isinstance(who, int)
            tenant, reserved = held.pop(who % len(held))
            s.settle(tenant, reserved, n, now)
        elif op == "limits":
            assert isinstance(who, str)
            limits[who] = Limits(tpm=n, rpm=max(1, n // 10), burst_tokens=n, max_concurrency=5)
        assert s.ledger.balanced()
        assert s.in_flight == len(held)
        assert s.ledger.outstanding == sum(r for _, r in held)
    for tenant, reserved in held:
        s.settle(tenant, reserved, reserved, now)
    assert s.in_flight == 0 and s.ledger.outstanding == 0
    assert s.ledger.precharged + s.ledger.excess == s.ledger.charged + s.ledger.refunded


def test_peek_says_what_admit_would_and_charges_nothing(make_state: type[TokenState]) -> None:
    s = make_state()
    assert s.peek("a", LIM, 1, now=0.0).admitted
    assert s.admit("a", LIM, 600, now=0.0).admitted
    v = s.peek("a", LIM, 1, now=0.0)
    assert not v.admitted and v.reason == "tpm"
    assert math.isclose(v.retry_after_s, 0.1)  # 1 token at 10/s
    assert s.peek("a", LIM, 1, now=0.1).admitted
    tokens, requests = s.view("a", LIM, now=0.1)
    assert (tokens.remaining, requests.remaining) == (1, 59)  # peeks used neither bucket
    assert s.in_flight == 1 and s.ledger.precharged == 600


def test_spend_charges_work_on_a_refused_prompt_into_debt(make_state: type[TokenState]) -> None:
    s = make_state()
    s.spend("a", LIM, 4100, now=0.0)
    tokens, requests = s.view("a", LIM, now=0.0)
    assert tokens.remaining == 0 and requests.remaining == 60  # no request used
    v = s.peek("a", LIM, 1, now=0.0)
    assert not v.admitted and v.reason == "tpm"
    assert math.isclose(v.retry_after_s, (4100 - 600 + 1) / 10)  # the debt is repaid first
    assert s.in_flight == 0
    assert s.ledger.charged == 4100 and s.ledger.outstanding == 0 and s.ledger.balanced()
