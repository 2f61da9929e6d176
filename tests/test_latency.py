"""Latency observed at settle: histograms, learned reservations, the SLO-driven limit, reloads."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy import kv as kvmath
from extproc.policy.schema import PolicyError, build_policy, hash_key
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime
from tests.test_stream import Clock, headers


def make_policy(*, reservation: str = "worst_case", precharge: str = "max_tokens", slo: bool = False,
                concurrency: int = 16) -> Any:
    premium: dict[str, Any] = {"priority": 10, "tpm": 10_000_000, "rpm": 100_000,
                               "max_queue_depth": 100, "max_queue_wait_ms": 5000}
    if slo:
        premium["ttft_p99_ms"] = 200
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": concurrency,
                      "kv_capacity_tokens": 100_000, "kv_block_size": 16, "kv_reservation": reservation,
                      "tpm_precharge": precharge, "adaptive_concurrency": {"min_samples": 3},
                      "models": [{"name": "m", "context_window": 8192}]}],
        "tiers": {"premium": premium,
                  "free": {"priority": 1, "tpm": 10_000_000, "rpm": 100_000,
                           "degrade": {"shed_below_scale": 0.7}}},
        "tenants": [{"name": "p", "tier": "premium", "keys": [hash_key("kp")]},
                    {"name": "f", "tier": "free", "keys": [hash_key("kf")]}],
    })


def body(max_tokens: int) -> pb.ProcessingRequest:
    raw = json.dumps({"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))


def chunk(data: bytes, end: bool, status: int = 200) -> pb.ProcessingRequest:
    r = pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))
    r.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = status
    return r


class Request:
    """One request driven phase by phase, the clock moved between phases."""

    def __init__(self, rt: Runtime, clock: Clock, key: str = "kp") -> None:
        self.rt, self.clock = rt, clock
        self.sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
        self.key = key

    def send(self, m: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        phase = m.WhichOneof("request")
        if phase != "request_body":
            r = self.sp.handle(phase, m)
            return [] if r is None else [r]

        async def go() -> list[pb.ProcessingResponse]:
            return [r async for r in self.sp.handle_body(m)]
        return asyncio.run(go())

    def admit(self, max_tokens: int) -> list[pb.ProcessingResponse]:
        self.send(headers(_path="/v1/chat/completions", _method="POST", authorization=f"Bearer {self.key}"))
        return self.send(body(max_tokens))

    def respond(self, ttft: float, rest: float, completion: int, status: int = 200) -> None:
        self.clock.now += ttft
        self.send(chunk(b'{"choices": [], ', False, status))
        self.clock.now += rest
        usage = json.dumps({"usage": {"prompt_tokens": 8, "completion_tokens": completion}}).encode()[1:]
        self.send(chunk(usage, True, status))


def sample(rt: Runtime, name: str, **labels: str) -> float:
    v = rt.metrics.registry.get_sample_value(name, labels)
    assert v is not None, (name, labels)
    return v


def test_settle_observes_ttft_itl_and_duration_per_backend_and_tier() -> None:
    clock = Clock()
    rt = Runtime(make_policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    r = Request(rt, clock)
    arrival = clock.now
    r.send(headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer kp"))
    clock.now += 0.1  # tokenizing, routing
    r.send(body(500))
    r.respond(ttft=0.3, rest=1.0, completion=51)
    labels = {"backend": "b", "tier": "premium"}
    assert sample(rt, "sluice_ttft_seconds_sum", **labels) == pytest.approx(0.3)
    assert sample(rt, "sluice_ttft_from_arrival_seconds_sum", **labels) == pytest.approx(0.4)
    assert sample(rt, "sluice_inter_token_seconds_sum", **labels) == pytest.approx(1.0 / 50)
    assert sample(rt, "sluice_request_duration_seconds_sum", **labels) == pytest.approx(clock.now - arrival)
    assert sample(rt, "sluice_ttft_seconds_count", **labels) == 1
    # The completion length was learned for the tenant and its tier.
    snap = rt.status()["completions"]
    assert {(e["kind"], e["name"]) for e in snap["estimates"]} == {("tenant", "p"), ("tier", "premium")}
    assert rt.status()["in_flight"] == 0 and rt.status()["ledger"]["balanced"]
    # The console's TTFT percentiles: cumulative bucket counts per tier in the status report.
    st = rt.status()
    bounds, counts = st["ttft_bounds_ms"], st["backends"]["b"]["ttft_counts"]
    assert list(counts) == ["premium"] and len(counts["premium"]) == len(bounds) + 1
    assert counts["premium"][bounds.index(300)] == 1 and sum(counts["premium"]) == 1  # 0.3 s: the 300 ms bucket
    rt.close()


def test_the_learned_length_is_exported_per_tier_and_model() -> None:
    clock = Clock()
    rt = Runtime(make_policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    teach(rt, clock, 25, completion=40)
    v = sample(rt, "sluice_completion_estimate_tokens", tier="premium", model="m")
    assert 40 <= v <= 51
    rt.close()


def test_failed_responses_teach_nothing() -> None:
    clock = Clock()
    rt = Runtime(make_policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    r = Request(rt, clock)
    r.admit(100)
    r.respond(ttft=0.1, rest=0.1, completion=0, status=500)
    assert rt.metrics.registry.get_sample_value("sluice_ttft_seconds_count", {"backend": "b", "tier": "premium"}) \
        is None
    assert rt.status()["backends"]["b"]["ttft_counts"] == {}
    assert len(rt.completions) == 0
    rt.close()


def teach(rt: Runtime, clock: Clock, n: int, completion: int, key: str = "kp", ttft: float = 0.05) -> None:
    for _ in range(n):
        r = Request(rt, clock, key)
        r.admit(1000)
        r.respond(ttft=ttft, rest=0.5, completion=completion)


@pytest.mark.parametrize("reservation", ["worst_case", "learned"])
def test_learned_reservation_holds_less_kv_but_precharges_max_tokens(reservation: str) -> None:
    clock = Clock()
    rt = Runtime(make_policy(reservation=reservation), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    teach(rt, clock, 25, completion=40)
    r = Request(rt, clock)
    before = sample(rt, "sluice_tokens_precharged_total", tenant="p")
    r.admit(1000)
    held = be.kv_in_use
    precharged = sample(rt, "sluice_tokens_precharged_total", tenant="p") - before
    assert precharged >= 1000  # the TPM contract: max_tokens by default
    if reservation == "learned":
        assert 40 < held <= kvmath.footprint(8 + 51, be.kv_block_size)  # prompt + the estimate (p95 bucket of 40s)
    else:
        assert held >= 1000
    r.respond(ttft=0.05, rest=0.5, completion=40)
    assert be.kv_in_use == 0 and rt.status()["ledger"]["balanced"]
    rt.close()


def test_learned_precharge_is_a_separate_option() -> None:
    clock = Clock()
    rt = Runtime(make_policy(precharge="learned"), clock=clock)
    rt.backends["b"].has_metrics = False
    teach(rt, clock, 25, completion=40)
    before = sample(rt, "sluice_tokens_precharged_total", tenant="p")
    r = Request(rt, clock)
    r.admit(1000)
    assert sample(rt, "sluice_tokens_precharged_total", tenant="p") - before < 100
    assert rt.backends["b"].kv_in_use >= 1000  # the KV reservation stays worst case
    r.respond(ttft=0.05, rest=0.5, completion=400)  # longer than learned: the excess is charged
    assert sample(rt, "sluice_tokens_excess_total", tenant="p") > 0
    assert rt.status()["ledger"]["balanced"]
    rt.close()


def test_slow_first_tokens_lower_the_limit_and_put_lower_tiers_under_pressure() -> None:
    clock = Clock()
    rt = Runtime(make_policy(slo=True), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    assert be.adaptive_limit is not None and be.adaptive_limit.limit(clock.now) == 16
    assert kvmath.pressure_scale(be, "free", clock.now) == 1.0
    # Premium requests see 0.6 s to the first token against a 200 ms SLO, 16 in flight.
    reqs = [Request(rt, clock) for _ in range(16)]
    for r in reqs:
        r.admit(100)
    clock.now += 0.6
    for r in reqs:
        r.respond(ttft=0.0, rest=0.0, completion=10)
        clock.now += 0.1
    clock.now += 1.0
    status = rt.status()["backends"]["b"]
    assert status["adaptive"]["limit"] < 16
    assert status["slots"]["effective"] == status["adaptive"]["limit"]
    assert "premium" in status["adaptive"]["at_risk"]
    # While premium misses its SLO, free is shed first (its ladder sees the floor).
    assert kvmath.pressure_scale(be, "free", clock.now) <= be.spec.watermark.floor
    assert kvmath.pressure_scale(be, "premium", clock.now) == 1.0
    refused = Request(rt, clock, "kf").admit(10)
    assert refused[-1].immediate_response.status.code == 503
    rt.close()


def test_estimates_and_the_limit_survive_a_policy_reload() -> None:
    clock = Clock()
    rt = Runtime(make_policy(reservation="learned", slo=True), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    teach(rt, clock, 25, completion=40, ttft=1.0)
    limit = be.adaptive_limit.limit(clock.now) if be.adaptive_limit else None
    assert limit is not None and limit < 16
    before = rt.completions.estimate("p", "premium", "m", 1000)
    rt.swap(make_policy(reservation="learned", slo=True, concurrency=12))
    assert rt.completions.estimate("p", "premium", "m", 1000) == before
    assert rt.backends["b"].adaptive_limit is be.adaptive_limit and be.adaptive_limit.limit(clock.now) == min(limit, 12)
    # Without any SLO the controller goes away and the limit is the backend's own.
    rt.swap(make_policy(reservation="learned"))
    assert rt.backends["b"].adaptive_limit is None
    assert rt.status()["backends"]["b"]["adaptive"] is None
    rt.close()


@pytest.mark.parametrize("patch,where", [
    ({"kv_reservation": "optimistic"}, "kv_reservation"),
    ({"tpm_precharge": "none"}, "tpm_precharge"),
    ({"learned_quantile": 1.5}, "learned_quantile"),
    ({"adaptive_concurrency": {"tolerance": 2.0}}, "tolerance"),
    ({"adaptive_concurrency": {"floor": 0}}, "floor"),
])
def test_policy_checks_the_new_backend_fields(patch: dict[str, Any], where: str) -> None:
    doc = {"backends": [{"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 64}],
                         **patch}],
           "tiers": {"t": {"tpm": 10, "rpm": 1, "ttft_p99_ms": 300}}, "tenants": []}
    with pytest.raises(PolicyError) as exc:
        build_policy(doc)
    assert where in str(exc.value)


def test_tier_slos_must_be_positive() -> None:
    doc = {"backends": [{"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 64}]}],
           "tiers": {"t": {"tpm": 10, "rpm": 1, "itl_p99_ms": 0}}, "tenants": []}
    with pytest.raises(PolicyError, match="itl_p99_ms"):
        build_policy(doc)
