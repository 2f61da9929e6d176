"""A tenant's budget across three extproc replicas sharing Redis, behind one Envoy, with
Redis killed and restarted empty in the middle of the period.

The same race as tests/e2e/test_budgets.py (32 streams, a small budget per minute):
the usage the clients received stays within the budget plus one reservation in every
period, before and after the restart; the period's count in the restarted Redis is
what the clients received (rebuilt from the replicas' views, not lost); the engine
served what the replicas settled; and the tenant is admitted again next period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.e2e.budget_load import BudgetLoad, admitted_again, budget_policy
from tests.e2e.fleet import Fleet, backend_metrics, start_fleet, stop_fleet
from tests.e2e.harness import eventually

pytestmark = pytest.mark.e2e

REPLICAS = 3
BUDGET = 6000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tmp_path_factory.mktemp("fleet-budgets"), REPLICAS, lambda port: budget_policy(port, BUDGET))
    eventually(lambda: {st["store"]["replicas"] for st in f.states()} == {REPLICAS}, 10, "3 replicas registered",
               interval=0.2)
    yield f
    stop_fleet(f)


def redis_settled(url: str, period: str) -> int:
    """The period's settled count as Redis holds it (carried over + what each replica settled)."""
    r = redis.Redis.from_url(url)
    raw = {k.decode(): v.decode() for k, v in r.hgetall(f"sluice:bud:t-budget:{period}").items()}
    r.close()
    total = float(raw.get("mt", 0))
    for k, v in raw.items():
        if k.startswith("h:"):
            f = [float(x) for x in v.split()]
            total += f[1] - f[3]
    return int(total)


def books(f: Fleet) -> list[dict[str, Any]]:
    return [st["budgets"]["ledgers"] for st in f.states()]


def test_three_replicas_hold_the_budget_through_a_redis_restart(fleet: Fleet) -> None:
    assert fleet.redis is not None
    # Start early in a minute, so the restart lands in the middle of the period being spent.
    eventually(lambda: time.time() % 60 < 20, 60, "the start of a minute", interval=0.2)
    m0 = backend_metrics(fleet.sim_url)
    spent0 = sum(b["tokens"]["spent"] for b in books(fleet))
    load = BudgetLoad(fleet.url, clients=32, stop_after_refusals_s=3.0)
    restarted: list[str] = []

    async def restart_midway(stop: asyncio.Event) -> None:
        while not stop.is_set():
            current = {a.period for a in load.answers[-10:] if a.period}
            used = sum(a.prompt + a.completion for a in load.answers if a.status == 200 and a.period in current)
            if used >= BUDGET * 0.4 and len(current) == 1:
                # In a thread: the clients keep sending while Redis is away.
                await asyncio.to_thread(fleet.redis.kill)  # type: ignore[union-attr]
                await asyncio.sleep(0.3)
                await asyncio.to_thread(fleet.redis.start)  # type: ignore[union-attr]  # empty: no persistence
                restarted.append(current.pop())
                return
            await asyncio.sleep(0.02)

    async def run() -> None:
        stop = asyncio.Event()
        await asyncio.gather(load.run(stop=stop), restart_midway(stop))

    asyncio.run(run())
    assert restarted, f"Redis was not restarted mid-period: {load.summary()}"
    summary = load.summary()
    sums = load.check_within_budget(BUDGET)
    refused = load.check_refusals(BUDGET, one_replica=False)
    assert sums[restarted[0]] >= BUDGET * 0.9, f"the period of the restart was spent: {sums}"
    assert any(a.period == restarted[0] for a in refused), "refused in the period Redis lost, after it came back"
    # While Redis was away a request may get a transient refusal (TPM's and the slots' local
    # shares, extproc.store.redis_state and slot_leases); nothing fails.
    assert set(summary) <= {"200", "429 budget", "429 tpm", "429 slots"}, summary
    assert summary["429 budget"] > 10 * sum(v for k, v in summary.items() if k in ("429 tpm", "429 slots"))
    fleet.wait_settled_all(30)
    prompt, completion = load.received()
    m1 = backend_metrics(fleet.sim_url)
    assert (m1["vllm:prompt_tokens_total"] - m0.get("vllm:prompt_tokens_total", 0),
            m1["vllm:generation_tokens_total"] - m0.get("vllm:generation_tokens_total", 0)) == (prompt, completion)
    after = books(fleet)
    assert sum(b["tokens"]["spent"] for b in after) - spent0 == prompt + completion
    assert all(b["balanced"] and b["tokens"]["outstanding"] == 0 for b in after)
    # The restarted Redis has the period's count again: what the clients received in it.
    in_period = sums[restarted[0]]
    eventually(lambda: redis_settled(fleet.redis.url, restarted[0]) == in_period, 5,  # type: ignore[union-attr]
               f"Redis's count of {restarted[0]} rebuilt to {in_period}")
    last = max(a.period for a in refused if a.period)
    again = asyncio.run(admitted_again(fleet.url, last))
    assert again.period and again.period > last
