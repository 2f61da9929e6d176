"""Sluice's own probes (extproc.service.prober), in process: what is probed, when, and what
the answer does to the breakers. The HTTP request is replaced by a recording function;
the real one goes through Envoy's backends in tests/e2e/test_breaker_probes.py."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.backends.probe import ProbeResult, request_for
from extproc.policy.breaker import BreakerState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.service.prober import Prober
from tests.test_stream import Clock


def runtime(clock: Clock, **backend: Any) -> Runtime:
    spec = {
        "name": "b",
        "address": "127.0.0.1:9",
        "max_concurrency": 8,
        "breaker": {
            "consecutive_failures": 2,
            "cooldown_s": 10,
            "max_cooldown_s": 10,
            "ramp_steps": [0.5, 1.0],
            "ramp_step_s": 5,
            "own_probe_after_s": 3,
        },
        "models": [{"name": "m", "context_window": 4096}],
        **backend,
    }
    if "endpoints" in spec:
        del spec["address"]
    rt = Runtime(
        build_policy(
            {
                "backends": [spec],
                "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
                "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("ka")]}],
            }
        ),
        clock=clock,
    )
    rt.backends["b"].has_metrics = False
    return rt


class FakeBackend:
    def __init__(self, failed: bool = False) -> None:
        self.failed = failed
        self.calls: list[tuple[str, str, str]] = []

    async def __call__(self, _session: object, url: str, kind: str, model: str) -> ProbeResult:
        self.calls.append((url, kind, model))
        return ProbeResult(self.failed, 500 if self.failed else 200, 0.01)


async def settle_probes(p: Prober) -> None:
    for t in list(p.in_flight.values()):
        await t


def test_a_half_open_breaker_without_traffic_is_probed_and_closes_on_its_own() -> None:
    """An engine stayed half-open for 16 minutes because light traffic never probed it."""
    clock = Clock()
    rt = runtime(clock)
    br = rt.backends["b"].breaker
    br.trip(clock.now)
    fake = FakeBackend()

    async def run() -> None:
        p = Prober(rt, session=None, send=fake)  # type: ignore[arg-type]
        clock.now += 10  # the cooldown ends: half-open, waiting for a probe
        p.tick()
        assert fake.calls == [], "not before own_probe_after_s without a probe"
        clock.now += 3
        p.tick()
        await settle_probes(p)
        assert fake.calls == [("http://127.0.0.1:9", "completions", "m")]
        assert br.snapshot(clock.now)["phase"] == "ramp"  # the probe passed: the time-based ramp
        clock.now += 10  # two ramp steps of 5 s
        assert br.state(clock.now) is BreakerState.CLOSED

    asyncio.run(run())
    rt.close()


def test_a_failing_own_probe_reopens_and_a_request_probing_first_takes_the_place() -> None:
    clock = Clock()
    rt = runtime(clock)
    br = rt.backends["b"].breaker
    br.trip(clock.now)
    fake = FakeBackend(failed=True)

    async def run() -> None:
        p = Prober(rt, session=None, send=fake)  # type: ignore[arg-type]
        clock.now += 13
        p.tick()
        await settle_probes(p)
        assert (
            br.state(clock.now) is BreakerState.OPEN
        )  # the backend still fails: a longer cooldown
        clock.now += 20
        assert br.allow(clock.now).allowed  # a request came first and is the probe
        clock.now += 5
        p.tick()
        assert len(fake.calls) == 1, "a probe is in flight: Sluice does not send another"

    asyncio.run(run())
    rt.close()


def test_a_lone_tenants_failure_is_confirmed_or_cleared_by_sluices_own_probe() -> None:
    clock = Clock()
    rt = runtime(clock, breaker={"consecutive_failures": 2, "own_probe_after_s": 3})
    be = rt.backends["b"]
    tb = be.tenant_breakers
    assert tb.record("a", Outcome.FAILURE, clock.now) is Outcome.TENANT_FAILURE

    async def run(fake: FakeBackend) -> None:
        p = Prober(rt, session=None, send=fake)  # type: ignore[arg-type]
        p.tick()
        await settle_probes(p)

    ok = FakeBackend()
    asyncio.run(run(ok))
    assert len(ok.calls) == 1 and not tb.backend_to_blame("a", clock.now)
    assert be.breaker.snapshot(clock.now)["window"]["failures"] == 0
    clock.now += 3
    tb.record("a", Outcome.FAILURE, clock.now)
    bad = FakeBackend(failed=True)
    asyncio.run(run(bad))
    assert tb.backend_to_blame("a", clock.now)
    assert (
        be.breaker.snapshot(clock.now)["window"]["failures"] == 1
    )  # the probe's failure is the backend's
    rt.close()


def test_each_engine_of_a_pool_is_probed_at_its_own_address() -> None:
    clock = Clock()
    rt = runtime(clock, endpoints=[{"address": "127.0.0.1:7001"}, {"address": "127.0.0.1:7002"}])
    eps = rt.backends["b"].endpoints
    assert eps is not None
    second = eps.by_key["127.0.0.1:7002"]
    second.breaker.trip(clock.now)
    fake = FakeBackend()

    async def run() -> None:
        p = Prober(rt, session=None, send=fake)  # type: ignore[arg-type]
        clock.now += 13
        p.tick()
        await settle_probes(p)

    asyncio.run(run())
    assert [c[0] for c in fake.calls] == ["http://127.0.0.1:7002"]
    assert second.breaker.snapshot(clock.now)["phase"] == "ramp"
    rt.close()


def test_each_kind_of_probe_is_the_smallest_request_of_its_api() -> None:
    assert request_for("health", "m") == ("GET", "/health", None)
    assert request_for("completions", "m") == (
        "POST",
        "/v1/completions",
        {"model": "m", "prompt": "ping", "max_tokens": 1},
    )
    method, path, body = request_for("chat", "m")
    assert (method, path, body and body["max_tokens"]) == ("POST", "/v1/chat/completions", 1)
    assert request_for("embeddings", "m")[1:] == ("/v1/embeddings", {"model": "m", "input": "ping"})
