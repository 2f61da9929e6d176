"""Tenant-scoped breakers through the stream state machine, in process (no Envoy)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.breaker import BreakerState
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from tests.test_stream import Clock, body, exchange, headers, response


def policy(**breaker: Any) -> Any:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8,
                      "breaker": {"consecutive_failures": 2, "cooldown_s": 1, "max_cooldown_s": 2,
                                  "ramp_steps": [1.0], "ramp_step_s": 0, **breaker},
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}, "small": {"tpm": 100, "rpm": 1000}},
        "tenants": [{"name": "good", "tier": "t", "keys": [hash_key("kg")]},
                    {"name": "bad", "tier": "t", "keys": [hash_key("kb")]},
                    {"name": "poor", "tier": "small", "keys": [hash_key("kp")]}],
    })


def ask(rt: Runtime, key: str, status: int = 200, max_tokens: int = 10) -> pb.ProcessingResponse:
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization=f"Bearer {key}")
    return asyncio.run(exchange(rt, hdr, body(max_tokens), response(status)))[-1]


def refused(r: pb.ProcessingResponse) -> tuple[int, str, dict[str, str]]:
    ir = r.immediate_response
    hs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, hs.get("x-sluice-reason", ""), hs


def test_one_tenants_500s_trip_its_breaker_and_not_the_backends() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    assert not ask(rt, "kg").HasField("immediate_response")
    seen = []
    for _ in range(6):  # one tenant: six free-key requests the backend answers with 500
        r = ask(rt, "kb", 500)
        seen.append(refused(r)[1] if r.HasField("immediate_response") else "sent")
        assert not ask(rt, "kg").HasField("immediate_response"), "the good tenant keeps being served"
    assert seen == ["sent", "sent"] + ["tenant_breaker_open"] * 4, "consecutive_failures 2, then refused"
    assert be.breaker.state(clock.now) is BreakerState.CLOSED
    code, reason, hs = refused(ask(rt, "kb"))
    assert (code, reason) == (503, "tenant_breaker_open")
    assert int(hs["retry-after"]) >= 1
    body_json = json.loads(ask(rt, "kb").immediate_response.body)
    assert body_json["error"]["code"] == "service_unavailable" and body_json["error"]["type"] == "server_error"
    st = rt.status()
    assert st["backends"]["b"]["breaker"]["state"] == "closed"
    assert st["backends"]["b"]["tenant_breakers"]["tripped"]["bad"]["state"] == "open"
    assert st["tenants"]["bad"]["rejections"] == {"tenant_breaker_open": 6}
    # After the cooldown its probe goes through; a success closes its breaker again.
    clock.now += 1.5
    assert not ask(rt, "kb").HasField("immediate_response")
    assert not ask(rt, "kb").HasField("immediate_response")
    assert rt.status()["backends"]["b"]["tenant_breakers"]["tripped"] == {}
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]
    rt.close()


def test_the_backend_failing_for_everyone_still_trips_the_shared_breaker() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    ask(rt, "kg")
    ask(rt, "kb", 500)  # could be bad's alone: good just succeeded
    ask(rt, "kg", 500)  # two tenants failing: the backend's
    ask(rt, "kb", 500)
    assert be.breaker.state(clock.now) is BreakerState.OPEN
    assert refused(ask(rt, "kg"))[:2] == (503, "breaker_open")
    assert refused(ask(rt, "kb"))[:2] == (503, "breaker_open")
    assert rt.status()["backends"]["b"]["tenant_breakers"]["tripped"] == {}
    rt.close()


def test_min_failing_tenants_1_blames_the_backend_as_before() -> None:
    clock = Clock()
    rt = Runtime(policy(min_failing_tenants=1), clock=clock)
    rt.backends["b"].has_metrics = False
    ask(rt, "kg")
    ask(rt, "kb", 500)
    ask(rt, "kg")
    ask(rt, "kb", 500)
    ask(rt, "kb", 500)
    assert refused(ask(rt, "kg"))[:2] == (503, "breaker_open")
    rt.close()


def test_a_tenant_probe_refused_after_winning_gives_its_place_back() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    ask(rt, "kg")
    ask(rt, "kp", 500, max_tokens=5)
    ask(rt, "kp", 500, max_tokens=5)
    assert refused(ask(rt, "kp", max_tokens=5))[1] == "tenant_breaker_open"
    clock.now += 1.5
    # Wins the tenant breaker's probe, then is refused for tokens (it needs more than 100).
    code, reason, _ = refused(ask(rt, "kp", max_tokens=500))
    assert (code, reason) == (429, "tpm_request_too_large")
    # The probe's place is free again: the next request may probe.
    assert not ask(rt, "kp", max_tokens=5).HasField("immediate_response")
    rt.close()


def test_a_shadowed_breaker_rule_records_the_tenant_refusal_but_lets_it_through() -> None:
    clock = Clock()
    p = policy()
    tiers = dict(p.tiers)
    tiers["t"] = tiers["t"].__class__(**{**tiers["t"].__dict__, "shadow": ("breaker",)})
    rt = Runtime(p.__class__(**{**p.__dict__, "tiers": tiers}), clock=clock)
    rt.backends["b"].has_metrics = False
    ask(rt, "kg")
    for _ in range(4):
        assert not ask(rt, "kb", 500).HasField("immediate_response"), "shadowed: never refused"
        ask(rt, "kg")
    assert rt.status()["backends"]["b"]["tenant_breakers"]["tripped"]["bad"]["state"] == "open"
    assert b'sluice_shadow_decisions_total{rule="breaker",tier="t"} 2.0' in rt.metrics.render()
    assert rt.backends["b"].breaker.state(clock.now) is BreakerState.CLOSED
    rt.close()


def test_a_model_with_its_own_breaker_judges_failures_among_that_models_tenants() -> None:
    # Two tenants fail on the broken model m while m2 serves them: m's failures are m's
    # (both fail on m, nobody succeeds there), so m's route breaker trips, not a tenant
    # breaker over the whole backend that would also refuse their m2 requests.
    clock = Clock()
    rt = Runtime(build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8,
                      "models": [{"name": "m", "context_window": 4096,
                                  "breaker": {"consecutive_failures": 2, "cooldown_s": 5, "max_cooldown_s": 5}},
                                 {"name": "m2", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("ka")]},
                    {"name": "z", "tier": "t", "keys": [hash_key("kz")]}],
    }), clock=clock)
    rt.backends["b"].has_metrics = False

    def ask_model(key: str, model: str, status: int = 200) -> pb.ProcessingResponse:
        hdr = headers(_path="/v1/chat/completions", _method="POST", authorization=f"Bearer {key}")
        raw = json.dumps({"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        req = pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))
        return asyncio.run(exchange(rt, hdr, req, response(status)))[-1]

    ask_model("kz", "m2")
    ask_model("ka", "m", 500)
    assert not ask_model("kz", "m2").HasField("immediate_response")
    ask_model("kz", "m", 500)  # two failing on m: m's from now on
    ask_model("ka", "m", 500)
    code, reason, _ = refused(ask_model("ka", "m"))
    assert (code, reason) == (503, "breaker_open")
    assert not ask_model("ka", "m2").HasField("immediate_response"), "a's other model is not refused"
    st = rt.status()["backends"]["b"]
    assert st["route_breakers"]["m"]["state"] == "open"
    assert st["tenant_breakers"]["tripped"] == {} and st["route_breakers"]["m"]["tenant_breakers"]["tripped"] == {}
    rt.close()


def test_in_an_outage_the_backend_breaker_takes_over_from_a_tripped_tenant() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    ask(rt, "kg")
    ask(rt, "kb", 500)
    ask(rt, "kb", 500)  # the busiest tenant fails first: blamed, its breaker opens
    assert refused(ask(rt, "kb"))[1] == "tenant_breaker_open"
    assert be.breaker.state(clock.now) is BreakerState.CLOSED
    ask(rt, "kg", 500)  # a second tenant failing: the backend's from now on
    ask(rt, "kg", 500)
    assert be.breaker.state(clock.now) is BreakerState.OPEN
    assert refused(ask(rt, "kb"))[1] == "breaker_open", "the backend's breaker is checked first"
    assert refused(ask(rt, "kg"))[1] == "breaker_open"
    rt.close()


def test_a_lone_tenants_failures_wait_for_sluices_own_probe_before_they_are_the_backends() -> None:
    """Fifteen mislabelled requests sent while no other tenant was succeeding opened the
    shared breakers for everyone: alone, a failure proves nothing about the backend."""
    clock = Clock()
    rt = Runtime(policy(consecutive_failures=3), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    for _ in range(3):
        ask(rt, "kb", 500)
    assert be.breaker.state(clock.now) is BreakerState.CLOSED
    assert refused(ask(rt, "kb"))[1] == "tenant_breaker_open"
    assert not ask(rt, "kg").HasField("immediate_response"), "everyone else is served"
    tb = be.tenant_breakers
    assert tb.probe_wanted(clock.now)  # extproc.service.prober asks the backend itself
    tb.probed(failed=True, now=clock.now)  # ... and it fails for Sluice too: the backend's
    assert not tb.probe_wanted(clock.now)
    for _ in range(3):
        ask(rt, "kp", 500)  # the next lone tenant's failures are the backend's now
    assert be.breaker.state(clock.now) is BreakerState.OPEN
    rt.close()
