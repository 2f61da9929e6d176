"""Shared budgets (extproc.store.budgets) on a real redis-server: several replicas in one
process (each its own RedisState: connection, registry, breaker), concurrent admits and
settles, leases, an outage, and a Redis restart that must not lose the period's count."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.redis_server import RedisServer
from extproc.policy.budget import ZERO, Amount, Budget
from extproc.policy.budget_ledger import BudgetHold, BudgetVerdict
from extproc.store.budgets import RedisBudgets
from extproc.store.redis_state import RedisState

DAY = Budget(period="day", tokens=5000, cost_nanos=50_000)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    try:
        yield s
    finally:
        s.stop()


async def fleet(url: str, n: int, prefix: str, **kw: Any) -> list[RedisBudgets]:
    out = []
    for i in range(n):
        st = RedisState(url, replica_id=f"r{i}", prefix=prefix, background=False, socket_timeout_s=0.5)
        assert await st._registered(time.monotonic())
        out.append(RedisBudgets(st, **kw))
    return out


async def close(books: list[RedisBudgets]) -> None:
    for b in books:
        await b.state.client.aclose()


async def admit(b: RedisBudgets, cost: Amount, budget: Budget = DAY, tenant: str = "t",
                wall: float | None = None) -> BudgetVerdict:
    v = b.admit(tenant, budget, cost, time.time() if wall is None else wall)
    if not isinstance(v, BudgetVerdict):
        v = await v
    return v


async def reconnect(b: RedisBudgets) -> None:
    """The client's connections broke with the server: the first command after a restart fails."""
    for _ in range(3):
        try:
            await b.state.client.ping()
            break
        except redis.ConnectionError:
            continue
    b.state.breaker.answered()


def redis_count(url: str, prefix: str, tenant: str = "t", budget: Budget = DAY) -> dict[str, float]:
    """The period's count as Redis holds it: settled and in flight, summed over holders."""
    r = redis.Redis.from_url(url)
    raw = {
        k.decode(): v.decode()
        for k, v in r.hgetall(f"{prefix}:bud:{tenant}:{budget.key(budget.span(time.time()))}").items()
    }
    r.close()
    out = {"settled_t": float(raw.get("mt", 0)), "settled_c": float(raw.get("mc", 0)), "out_t": 0.0}
    for k, v in raw.items():
        if k.startswith("h:"):
            f = [float(x) for x in v.split()]
            out["settled_t"] += f[1] - f[3]
            out["settled_c"] += f[2] - f[4]
            out["out_t"] += f[5]
    return out


def test_admit_reserves_and_settles_through_redis(server: RedisServer) -> None:
    async def run() -> None:
        [b] = await fleet(server.url, 1, "one", slice_fraction=0)
        v = await admit(b, Amount(3000, 30_000))
        assert v.admitted and v.hold is not None
        refused = await admit(b, Amount(2500, 100))
        assert not refused.admitted and refused.reason == "budget" and refused.retry_after_s
        assert refused.retry_after_s <= 86400
        b.settle(v.hold, Amount(1000, 10_000), time.time())
        await b.sync()
        assert redis_count(server.url, "one") == {"settled_t": 1000, "settled_c": 10_000, "out_t": 0}
        again = await admit(b, Amount(2500, 100))
        assert again.admitted and again.view.used == Amount(3500, 10_100)
        too_big = await admit(b, Amount(5001, 0))
        assert too_big.reason == "budget_request_too_large"
        assert again.hold is not None
        b.settle(again.hold, again.hold.cost, time.time())
        await b.sync()
        assert b.ledgers.snapshot()["balanced"] and b.ledgers.outstanding_t == 0
        await close([b])

    asyncio.run(run())


def test_three_replicas_never_reserve_past_the_budget(server: RedisServer) -> None:
    """Concurrent admits and settles on three replicas (leases on): Redis's count of what is
    spent and reserved never passes the budget, and the period ends within it."""
    budget = Budget(period="day", tokens=20_000)
    samples: list[float] = []

    async def run() -> None:
        books = await fleet(server.url, 3, "three")
        rng = random.Random(7)
        admitted: list[int] = []
        stop = asyncio.Event()

        async def client(b: RedisBudgets) -> None:
            while not stop.is_set():
                cost = Amount(rng.randint(50, 400), 0)
                v = await admit(b, cost, budget)
                if not v.admitted:
                    await asyncio.sleep(0.002)
                    continue
                assert v.hold is not None
                await asyncio.sleep(rng.uniform(0, 0.004))
                used = Amount(cost.tokens * rng.randint(20, 100) // 100, 0)
                admitted.append(used.tokens)
                b.settle(v.hold, used, time.time())
                if rng.random() < 0.3:
                    await b.sync(only_due=True)

        async def sampler() -> None:
            while not stop.is_set():
                c = redis_count(server.url, "three", budget=budget)
                samples.append(c["settled_t"] + c["out_t"])
                await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(client(b)) for b in books for _ in range(8)]
        tasks.append(asyncio.create_task(sampler()))
        for _ in range(400):
            await asyncio.sleep(0.01)
            if sum(admitted) > budget.tokens * 0.98:
                break
        stop.set()
        await asyncio.gather(*tasks)
        for b in books:
            await b.sync()
        final = redis_count(server.url, "three", budget=budget)
        assert final["out_t"] == 0 and final["settled_t"] == sum(admitted)
        assert sum(admitted) <= budget.tokens
        assert sum(b.ledgers.spent_t for b in books) == sum(admitted)
        await close(books)

    asyncio.run(run())
    assert samples and max(samples) <= 20_000, "spent + reserved (leases aside) never passed the budget"


def test_a_lease_admits_without_a_round_trip_and_goes_back(server: RedisServer) -> None:
    async def run() -> None:
        [b] = await fleet(server.url, 1, "lease", slice_fraction=0.2)
        first = await admit(b, Amount(10, 10))  # one exchange: admits, and brings a lease
        assert first.admitted and b.exchanges == 1
        for _ in range(20):
            v = b.admit("t", DAY, Amount(10, 10), time.time())
            assert isinstance(v, BudgetVerdict) and v.admitted, "from the lease, synchronously"
        assert b.exchanges == 1
        await b.sync()
        assert redis_count(server.url, "lease")["out_t"] == 210
        await close([b])

    asyncio.run(run())


def test_a_redis_restart_does_not_lose_the_period(server: RedisServer) -> None:
    """Redis comes back empty: the replicas' last views (and what each settled since) make
    the period's count again; a replica that never saw it starts from the console's copy."""
    async def run() -> None:
        books = await fleet(server.url, 3, "restart", slice_fraction=0)
        holds: list[tuple[RedisBudgets, BudgetHold]] = []
        for i in range(9):
            b = books[i % 3]
            v = await admit(b, Amount(400, 4000))
            assert v.admitted and v.hold is not None
            holds.append((b, v.hold))
        for b, h in holds[:6]:
            b.settle(h, Amount(300, 3000), time.time())
        for b in books:
            await b.sync()
        before = redis_count(server.url, "restart")
        assert before == {"settled_t": 1800, "settled_c": 18_000, "out_t": 1200}
        # Settled after the last answer each replica got: known to none but itself.
        for b, h in holds[6:]:
            b.settle(h, Amount(100, 1000), time.time())
        server.kill()
        server.start()
        for b in books:
            await reconnect(b)
        for b in reversed(books):
            await b.sync()
        after = redis_count(server.url, "restart")
        assert after == {"settled_t": 2100, "settled_c": 21_000, "out_t": 0}
        # 2100 of 5000 tokens settled: 2900 fit, 2901 do not
        assert not (await admit(books[1], Amount(2901, 0))).admitted
        v = await admit(books[2], Amount(2900, 0))
        assert v.admitted
        # Lost again; now only a new replica with the console's copy is there to rebuild it.
        server.kill()
        server.start()
        [fresh] = await fleet(server.url, 1, "restart", slice_fraction=0)
        fresh.seed("t", DAY.key(DAY.span(time.time())), Amount(5000, 21_000))
        assert not (await admit(fresh, Amount(1, 0))).admitted
        assert redis_count(server.url, "restart")["settled_t"] == 5000
        await close([*books, fresh])

    asyncio.run(run())


def test_an_outage_admits_from_the_lease_then_a_local_share_or_refuses(server: RedisServer) -> None:
    async def run() -> None:
        [b] = await fleet(server.url, 1, "down", slice_fraction=0.1)
        [closed] = await fleet(server.url, 1, "down-closed", slice_fraction=0, fail_closed=True)
        assert (await admit(b, Amount(100, 100))).admitted  # and a lease of 10 % (500 tokens)
        assert (await admit(closed, Amount(100, 100))).admitted
        server.pause()
        try:
            assert b.admit("t", DAY, Amount(400, 400), time.time()).admitted  # from the lease
            v = await admit(b, Amount(600, 600))  # the lease cannot: one exchange fails
            assert v.admitted and not b.state.up, "the local share: half the room seen, one replica"
            # 5000 - 500 used = 4500 seen (the lease's unused 100 aside): a share of 2250
            assert (await admit(b, Amount(1650, 1650))).admitted
            assert not (await admit(b, Amount(1, 1))).admitted
            refused = await admit(closed, Amount(1, 1))
            assert refused.reason == "state_store_down"
        finally:
            server.resume()
        await reconnect(b)
        await b.sync()
        assert redis_count(server.url, "down")["out_t"] == 2750
        await close([b, closed])

    asyncio.run(run())


def test_a_request_settles_into_the_period_it_was_admitted_in(server: RedisServer) -> None:
    minute = Budget(period="minute", tokens=100)

    async def run() -> None:
        [b] = await fleet(server.url, 1, "roll", slice_fraction=0)
        wall = (time.time() // 60) * 60 + 59.5
        v = await admit(b, Amount(100, 0), minute, wall=wall)
        assert v.admitted and v.hold is not None
        assert (await admit(b, Amount(100, 0), minute, wall=wall + 1)).admitted, "a new minute, a new count"
        b.settle(v.hold, Amount(40, 0), wall + 2)
        await b.sync()
        old = redis.Redis.from_url(server.url).hgetall(f"roll:bud:t:{v.hold.key}")
        assert old and b.view("t", minute, wall).used == Amount(40, 0)
        assert b.view("t", minute, wall + 1).used == Amount(100, 0)
        assert b.view("t", minute, wall + 61).used == ZERO
        await close([b])

    asyncio.run(run())
