"""Breakers that one tenant cannot open for everyone, and that recover without traffic,
through the real Envoy (extproc.service.prober sends Sluice's own probes).

Seen in the hostile hour: fifteen requests that made the engine answer 500, sent when no
other tenant happened to be succeeding, opened the shared breakers of the pool and its
fallback (premium got 503 breaker_open for 30 s); and an engine then stayed half-open for
16 minutes because light traffic never probed it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.procs import post_json
from tests.e2e import harness
from tests.e2e.harness import TEST_KEYS, Stack, eventually, free_port, running
from tests.e2e.test_pools import PoolStack
from tests.e2e.test_pools import policy as pool_policy

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
BREAKER = {
    "window_s": 2,
    "consecutive_failures": 3,
    "cooldown_s": 1,
    "max_cooldown_s": 2,
    "ramp_steps": [1.0],
    "ramp_step_s": 0.5,
    "own_probe_after_s": 0.5,
}
# cooldown (at most max_cooldown_s) + own_probe_after_s + the ramp + the prober's tick, with room
VERDICT_BOUND_S = 10.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("probes"))
    doc = harness.test_policy(s.sim_port)
    doc["backends"][0]["breaker"] = BREAKER
    s.policy_doc = doc
    with running(s) as started:
        yield started


def ask(s: Stack, tier: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        s.url + CHAT,
        json={
            "model": "sim-llama-8b",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers={"authorization": f"Bearer {TEST_KEYS[tier]}", **(headers or {})},
        timeout=15,
    )


def breaker(s: Stack) -> dict[str, Any]:
    return s.state()["backends"]["sim"]["breaker"]


def probes(s: Stack, why: str, result: str) -> float:
    return s.metric_sum("sluice_backend_probes_total", backend="sim", why=why, result=result)


def test_one_tenants_failures_with_nobody_else_sending_open_only_its_own_breaker(
    stack: Stack,
) -> None:
    stack.clear_sim_requests()
    seen = [ask(stack, "tiny", {"x-sim-status": "500"}) for _ in range(6)]
    reasons = [r.headers.get("x-sluice-reason") for r in seen]
    assert [r.status_code for r in seen[:3]] == [500] * 3 and reasons[3:] == [
        "tenant_breaker_open"
    ] * 3, reasons
    assert breaker(stack)["state"] == "closed"
    # Sluice asked the engine itself, and it served: the failures stay the tenant's.
    eventually(lambda: probes(stack, "blame", "ok") >= 1, 5, "Sluice's own probe")
    probe = [q for q in stack.sim_requests() if q["headers"].get("user-agent") == "sluice-probe"]
    assert probe and "x-sluice-tenant" not in probe[0]["headers"]  # nobody is billed for it
    r = ask(stack, "premium")
    assert r.status_code == 200, r.text


def test_a_backend_failing_for_sluice_too_opens_and_recovers_without_any_traffic(
    stack: Stack,
) -> None:
    # Alone again: the test before's failures have left the window.
    eventually(
        lambda: stack.state()["backends"]["sim"]["tenant_breakers"]["tracked_tenants"] == 0,
        10,
        "the earlier outcomes to leave the breaker's window",
    )
    post_json(
        f"{stack.sim_url}/admin/config", {"fail_status": 500}
    )  # the engine fails for everyone
    try:

        def opened() -> bool:
            ask(stack, "other")  # one tenant, alone: its failures wait for Sluice's probe
            return breaker(stack)["state"] == "open"

        eventually(opened, 10, lambda: f"the breaker: {breaker(stack)}", interval=0.2)
        assert (
            probes(stack, "blame", "failed") >= 1
        )  # it was Sluice's own probe that made it the backend's
        assert ask(stack, "premium").headers.get("x-sluice-reason") == "breaker_open"
    finally:
        post_json(f"{stack.sim_url}/admin/config", {"fail_status": None})
    # No client sends anything from here on: the breaker must still reach its verdict.
    t0 = time.monotonic()
    eventually(
        lambda: breaker(stack)["state"] == "closed",
        VERDICT_BOUND_S,
        lambda: f"still {breaker(stack)} after {time.monotonic() - t0:.1f} s without traffic",
    )
    assert probes(stack, "half_open", "ok") >= 1
    assert ask(stack, "premium").status_code == 200


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolStack]:
    s = PoolStack(tmp_path_factory.mktemp("probes-pool"))
    s.big_port = free_port()
    doc = pool_policy(s.sim_port, s.big_port)
    doc["backends"][0]["breaker"].update(own_probe_after_s=0.5)
    s.policy_doc = doc
    with running(s):
        yield s


def test_a_pool_engine_half_open_under_light_traffic_is_probed_back_to_closed(
    pool: PoolStack,
) -> None:
    big = f"127.0.0.1:{pool.big_port}"

    def engine(key: str) -> dict[str, Any]:
        return {e["address"]: e for e in pool.state()["backends"]["sim"]["endpoints"]}[key]

    eventually(lambda: engine(big)["usable"], 10, "the big engine scraped and usable")
    post_json(f"{pool.big_url}/admin/config", {"fail_status": 500})
    try:

        def failed_open() -> bool:
            httpx.post(
                pool.url + CHAT,
                json={
                    "model": "sim-llama-8b",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "x " * 600}],
                },
                headers={"authorization": "Bearer sk-pool-premium"},
                timeout=15,
            )
            return engine(big)["breaker"]["state"] == "open"

        eventually(
            failed_open,
            20,
            lambda: f"the big engine's breaker: {engine(big)['breaker']}",
            interval=0.05,
        )
    finally:
        post_json(f"{pool.big_url}/admin/config", {"fail_status": None})
    eventually(
        lambda: engine(big)["breaker"]["state"] == "closed",
        VERDICT_BOUND_S,
        lambda: f"the big engine stayed {engine(big)['breaker']} without traffic",
    )
