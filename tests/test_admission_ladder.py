"""``admission.route`` carries out the ladder's decision (extproc.policy.ladder) on a real
Runtime: the ticket it builds, the probe places it gives back, the shadow metrics, the
``Refusal`` a client would see."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.policy import kv
from extproc.policy.breaker import BreakerState
from extproc.policy.schema import Policy, build_policy, hash_key
from extproc.request.admission import route
from extproc.request.refusal import Refusal
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime
from tests.metrics_fake import RecordingMetrics

BREAKER = {"consecutive_failures": 2, "min_requests": 100, "cooldown_s": 10, "max_cooldown_s": 10,
           "ramp_steps": [1.0], "ramp_step_s": 0, "min_failing_tenants": 1}


def policy(shadow: list[str] | None = None) -> Policy:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8, "breaker": BREAKER,
                      "models": [{"name": "m", "context_window": 4096, "fallback_model": "s"}]},
                     {"name": "f", "address": "127.0.0.1:2", "max_concurrency": 8, "breaker": BREAKER,
                      "models": [{"name": "s", "context_window": 1000}]}],
        "tiers": {"t": {"tpm": 10**6, "rpm": 1000, "shadow": shadow or [],
                        "degrade": {"fallback_below_scale": 0.9, "clamp_max_tokens": 100, "clamp_below_scale": 0.95}}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("ka")]}],
    })


def runtime(**kw: Any) -> Runtime:
    return Runtime(policy(**kw), clock=lambda: 0.0, metrics=RecordingMetrics())


def routed(rt: Runtime, now: float, completion: int = 400) -> Ticket:
    p = rt.policy
    tenant = p.tenants["a"]
    backend, model = p.by_model["m"]
    return route(rt, p, p.tiers[tenant.tier], tenant.name, backend, model, completion, now)


def pressure(rt: Runtime, until: float) -> None:
    """Backend b's cache near full for ``until`` seconds: its scale falls to the floor (0.6)."""
    be = rt.backends["b"]
    be.has_metrics = True
    for t in range(int(until) + 1):
        be.wm.observe(0.99, None, float(t))
    assert kv.pressure_scale(be, "t", until) < 0.9


def trip(rt: Runtime, name: str, now: float) -> None:
    br = rt.backends[name].breaker
    br.record_failure(now)
    br.record_failure(now)
    assert br.state(now) is BreakerState.OPEN


def test_no_pressure_no_breaker_the_request_goes_as_asked() -> None:
    rt = runtime()
    t = routed(rt, 0.0)
    assert (t.backend.name, t.model.name, t.completion, t.degraded) == ("b", "m", 400, [])
    rt.close()


def test_under_pressure_the_fallback_then_the_clamp_and_the_primary_probe_goes_back() -> None:
    rt = runtime()
    trip(rt, "b", 0.0)
    pressure(rt, 30.0)  # b half-open at 30: this request's allow takes its one probe place
    t = routed(rt, 30.0)
    assert (t.backend.name, t.model.name, t.completion, t.degraded) == ("f", "s", 100, ["fallback", "max_tokens"])
    assert t.breaker_verdict is not None and t.breaker_verdict.allowed  # f's, reported at settle
    assert rt.backends["b"].breaker.allow(30.0).allowed, "the probe place b gave this request went back"
    rt.close()


def test_an_open_breaker_goes_to_the_fallback_and_no_further_rung() -> None:
    rt = runtime()
    trip(rt, "b", 0.0)
    pressure(rt, 5.0)
    t = routed(rt, 5.0)
    assert (t.backend.name, t.completion, t.degraded) == ("f", 400, ["fallback"])  # capped at 500, not clamped
    rt.close()


def test_model_and_fallback_down_is_a_503_with_retry_after() -> None:
    rt = runtime()
    trip(rt, "b", 0.0)
    trip(rt, "f", 0.0)
    with pytest.raises(Refusal) as e:
        routed(rt, 1.0)
    assert (e.value.reason, e.value.code) == ("breaker_open", "service_unavailable")
    assert e.value.message == "Backend 'b' is unavailable (breaker_open); retry later."  # f is open: no fallback
    assert int(e.value.headers["retry-after"]) >= 9
    rt.close()


def test_shadowed_degradation_is_counted_per_rung_and_not_applied() -> None:
    rt = runtime(shadow=["degrade"])
    pressure(rt, 30.0)
    t = routed(rt, 30.0)
    assert (t.backend.name, t.completion, t.degraded) == ("b", 400, [])
    m = rt.metrics
    assert isinstance(m, RecordingMetrics)
    shadowed = [e.args for e in m.events if e.name == "shadowed"]
    assert shadowed == [{"rule": "degrade", "tier": "t"}] * 2  # the fallback rung and the clamp rung
    rt.close()


def test_a_shadowed_open_breaker_lets_the_request_through_with_nothing_to_report() -> None:
    rt = runtime(shadow=["breaker"])
    trip(rt, "b", 0.0)
    trip(rt, "f", 0.0)  # no fallback to take
    t = routed(rt, 1.0, completion=50)
    assert (t.backend.name, t.breaker_verdict, t.route_verdict) == ("b", None, None)
    m = rt.metrics
    assert isinstance(m, RecordingMetrics)
    assert [e.args["rule"] for e in m.events if e.name == "shadowed"] == ["breaker"]
    rt.close()


def test_a_shed_request_gives_its_half_open_probe_back() -> None:
    p = build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8, "breaker": BREAKER,
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 10**6, "rpm": 1000, "degrade": {"shed_below_scale": 0.9}}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("ka")]}],
    })
    rt = Runtime(p, clock=lambda: 0.0, metrics=RecordingMetrics())
    trip(rt, "b", 0.0)
    pressure(rt, 30.0)  # half-open at 30: the shed request's allow takes the probe place
    with pytest.raises(Refusal) as e:
        routed(rt, 30.0)
    assert e.value.reason == "overloaded"
    assert rt.backends["b"].breaker.allow(30.0).allowed, "the shed request's probe place went back"
    rt.close()
