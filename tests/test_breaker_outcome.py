"""A request's outcome reaches its breakers in one place (``Ticket.report_outcome``), once,
whether admission gives a probe back or settle reports how the request ended."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.breaker import BreakerState
from extproc.policy.breaker_outcome import Outcome, outcome_at_settle
from extproc.policy.schema import Policy, build_policy, hash_key
from extproc.request.admission import route
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime

OPEN, CLOSED = BreakerState.OPEN, BreakerState.CLOSED


@pytest.mark.parametrize(("how", "status", "outcome"), [
    ("end_of_stream", 200, Outcome.SUCCESS),
    ("end_of_stream", 404, Outcome.CLIENT_ERROR),
    ("end_of_stream", 429, Outcome.CLIENT_ERROR),
    ("end_of_stream", 503, Outcome.FAILURE),
    ("end_of_stream", 0, Outcome.CANCELLED),  # ended before any status: nothing learned
    ("error", 0, Outcome.FAILURE),
    ("error", 200, Outcome.FAILURE),
    ("disconnect", 200, Outcome.CANCELLED),
    ("rejected", 0, Outcome.CANCELLED),
    ("reset", 0, Outcome.CANCELLED),
])
def test_outcome_at_settle(how: str, status: int, outcome: Outcome) -> None:
    assert outcome_at_settle(how, status) is outcome


def policy() -> Policy:
    breaker = {"consecutive_failures": 2, "min_requests": 100, "cooldown_s": 10, "max_cooldown_s": 10,
               "ramp_steps": [1.0], "ramp_step_s": 0, "min_failing_tenants": 1}
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8, "breaker": breaker,
                      "models": [{"name": "m", "context_window": 4096, "breaker": breaker}]}],
        "tiers": {"t": {"tpm": 10**6, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("ka")]}],
    })


async def _no_messages() -> AsyncIterator[pb.ProcessingRequest]:
    return
    yield


def routed(rt: Runtime, now: float) -> Ticket:
    p = rt.policy
    tenant = p.tenants["a"]
    backend, model = p.by_model["m"]
    return route(rt, p, p.tiers[tenant.tier], tenant.name, backend, model, 10, now)


def test_a_ticket_reports_its_outcome_to_each_breaker_once() -> None:
    rt = Runtime(policy(), clock=lambda: 0.0)
    be = rt.backends["b"]
    route = be.route_breakers["m"]
    first = routed(rt, 0.0)
    first.report_outcome(Outcome.FAILURE, None, 0.0)
    first.report_outcome(Outcome.FAILURE, None, 0.0)  # a second report is not heard
    assert (be.breaker.state(0.0), route.state(0.0)) == (CLOSED, CLOSED)
    routed(rt, 0.0).report_outcome(Outcome.FAILURE, None, 0.0)  # another request's failure is
    assert (be.breaker.state(0.0), route.state(0.0)) == (OPEN, OPEN)
    rt.close()


def test_a_probe_given_back_frees_the_half_open_place() -> None:
    rt = Runtime(policy(), clock=lambda: 0.0)
    be = rt.backends["b"]
    for _ in range(2):
        routed(rt, 0.0).report_outcome(Outcome.FAILURE, None, 0.0)
    assert be.breaker.state(0.0) is OPEN
    probe = routed(rt, 11.0)  # after the cooldown: this one is the probe
    assert probe.breaker_verdict is not None and probe.breaker_verdict.allowed
    assert not be.breaker.allow(11.0).allowed, "one probe at a time"
    probe.report_outcome(Outcome.CANCELLED, None, 11.0)
    probe.report_outcome(Outcome.SUCCESS, None, 11.0)  # already reported: ignored
    assert be.breaker.state(11.0) is not CLOSED, "a cancelled probe proves nothing"
    again = routed(rt, 11.0)
    assert again.breaker_verdict is not None and again.breaker_verdict.allowed, "the place went back"
    again.report_outcome(Outcome.SUCCESS, 0.1, 11.0)
    assert be.breaker.state(11.0) is CLOSED
    rt.close()
