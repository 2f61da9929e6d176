"""RedisState across replicas on a real redis-server: the token leases, their accuracy
under concurrent load, lost replies, fencing, and giving leases back.

tests/test_state_redis_outage.py takes Redis away; tests/test_policy_gate.py runs the
bucket rules; tests/redis_replicas.py has the replicas and the load.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.redis_server import RedisServer
from extproc.policy.gate import Verdict
from extproc.policy.schema import Limits
from extproc.store.client import connect
from extproc.store.redis_state import RedisState
from tests.redis_replicas import (
    RATE,
    Load,
    admit,
    close_all,
    replicas,
)
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture


def test_far_from_the_limit_admissions_stay_local_near_it_each_asks_redis(redis_server: RedisServer) -> None:
    async def main() -> tuple[int, int]:
        (s,) = replicas(redis_server.url, 1, "lease1")
        lim = Limits(tpm=600_000, rpm=1_000_000, burst_tokens=100_000, max_concurrency=10)
        for _ in range(200):  # 2,000 of 100,000 tokens: the lease covers almost all
            assert (await admit(s, 10, lim)).admitted
        far = s.exchanges
        tight = Limits(tpm=60, rpm=1_000_000, burst_tokens=200, max_concurrency=10)
        for _ in range(19):  # 190 of 200 tokens: the slice shrinks to nothing
            assert (await admit(s, 10, tight, tenant="u")).admitted
        near_before = s.exchanges
        for _ in range(5):
            await admit(s, 10, tight, tenant="u")
        near = s.exchanges - near_before
        await close_all([s])
        return far, near

    far, near = asyncio.run(main())
    assert far <= 10, f"{far} round trips for 200 admissions far from the limit"
    assert near == 5, "near the limit every admission is decided by Redis"


def test_three_replicas_share_one_budget_under_concurrent_load(redis_server: RedisServer) -> None:
    async def main() -> Load:
        states = replicas(redis_server.url, 3, "acc3")
        for s in states:  # register, so each knows the others
            await admit(s, 1)
        await asyncio.sleep(0.3)
        load = Load(states, workers_per_state=21)  # 63 concurrent clients
        await load.run(6.0)
        await close_all(states)
        return load

    load = asyncio.run(main())
    assert not load.not_rate
    t_start = min(t for t, *_ in load.events)
    for w in (0.5, 1.0, 2.0, 6.0):
        assert load.worst_window(w) <= 1.02, f"window {w}s: {load.worst_window(w):.3f} x the contract"
    steady = load.tokens(t_start + 1.5, t_start + 5.5) / (RATE * 4.0)
    assert steady >= 0.95, f"steady consumption {steady:.3f} x TPM"
    assert {r for _, _, r, _ in load.events} == {0, 1, 2}  # every replica got a share


@pytest.fixture(scope="module")
def loop_and_client(redis_server: RedisServer) -> Iterator[tuple[asyncio.AbstractEventLoop, Any]]:
    loop = asyncio.new_event_loop()
    client = connect(redis_server.url, socket_timeout_s=5.0)
    yield loop, client
    loop.run_until_complete(client.aclose())
    loop.close()


_bound_runs = itertools.count()
SMALL = Limits(tpm=600, rpm=60_000, burst_tokens=100, max_concurrency=10)  # 10 tokens/s, a bucket of 100


@settings(max_examples=200, deadline=None)
@given(n=st.sampled_from([1, 3, 8]),
       ops=st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["admit", "admit", "admit", "sync"]),
                              st.integers(1, 40), st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.4, 3.0])),
                    min_size=1, max_size=80))
def test_overshoot_bound_holds_exactly_for_any_replica_count(
        loop_and_client: tuple[asyncio.AbstractEventLoop, Any], n: int, ops: list[tuple[int, str, int, float]]) -> None:
    """The README's bound with exact settles: admitted(W) <= B + r*W in every window, for any N.

    Replicas interleave admissions and lease refreshes at times the test chooses (the
    scripts take the caller's clock), so every window is checked without tolerance.
    """
    loop, client = loop_and_client
    prefix = f"bound{next(_bound_runs)}"
    states = [RedisState(client=client, replica_id=f"f{i}", prefix=prefix, caller_clock=True, background=False,
                         lease_ttl_s=2.0, admit_wait_s=5.0, slice_fraction=0.5) for i in range(n)]
    now, admitted = 0.0, []
    for who, op, cost, dt in ops:
        now += dt
        s = states[who % n]
        if op == "sync":
            loop.run_until_complete(s.sync(now, only_due=False))
            continue
        v = s.admit("t", SMALL, cost, now)
        if not isinstance(v, Verdict):
            v = loop.run_until_complete(v)  # type: ignore[arg-type]
        if v.admitted:
            admitted.append((now, cost))
            s.settle("t", cost, cost, now)
    rate = SMALL.tpm / 60.0
    for i, (t0, _) in enumerate(admitted):
        total = 0
        for t1, cost in admitted[i:]:
            total += cost
            assert total <= SMALL.burst_tokens + rate * (t1 - t0) + 1e-6, (n, t0, t1, total)


def test_a_spent_lease_frees_room_only_from_when_redis_learns_of_it(
        loop_and_client: tuple[asyncio.AbstractEventLoop, Any]) -> None:
    """Refill while the bucket (level + leases) was full is gone; spending the lease later does not bring it back."""
    loop, client = loop_and_client
    s = RedisState(client=client, replica_id="room", prefix="room", caller_clock=True, background=False,
                   lease_ttl_s=100.0, admit_wait_s=5.0, slice_fraction=0.5)

    def take(cost: int, now: float) -> bool:
        v = s.admit("t", SMALL, cost, now)
        if not isinstance(v, Verdict):
            v = loop.run_until_complete(v)  # type: ignore[arg-type]
        return v.admitted

    assert take(1, 0.0)  # a lease of 49 is taken; the bucket stays full for 3 s
    assert s._tenants["t"].lease_t == 49
    spent = 0
    while take(10, 3.0):  # spend the lease and then the rest of the bucket, all at t=3
        spent += 10
    assert 90 <= spent <= SMALL.burst_tokens


def test_lost_replies_are_resent_without_double_counting(redis_server: RedisServer) -> None:
    """An exchange that reached Redis but whose reply was lost: the next one carries the same counters."""
    async def main() -> tuple[float, float]:
        (s,) = replicas(redis_server.url, 1, "lost")
        assert (await admit(s, 100)).admitted
        s.settle("t", 100, 40, time.monotonic())  # refund 60
        ls = s._tenants["t"]
        args = s._args(ls, time.monotonic(), [50], want=True)
        key = "lost:tb:t"
        keys = [key, s.registry.keys[0]]
        await s._script(keys=keys, args=args)  # applied; the reply "lost"
        await s._script(keys=keys, args=args)  # sent again unchanged
        await s.sync(time.monotonic(), only_due=False)
        await s.aclose()
        level = float(await s.client.hget(key, "tl"))
        await s.client.aclose()
        return level, ls.lease_t

    level, lease = asyncio.run(main())
    # 1000 - 100 + 60 refunded; the twice-sent grant of 50 came back; the lease returned at close.
    assert lease == 0
    assert 960 <= level <= 1000, level  # (plus refill since, capped at the bucket)


def test_a_replica_paused_past_the_registry_ttl_is_fenced_and_registers_again(
        loop_and_client: tuple[asyncio.AbstractEventLoop, Any]) -> None:
    loop, client = loop_and_client
    a, b = (RedisState(client=client, replica_id=name, prefix="fence", caller_clock=True, background=False,
                       lease_ttl_s=5.0, admit_wait_s=5.0, registry_ttl_s=10.0) for name in ("a", "b"))

    def take(s: RedisState, cost: int, now: float) -> bool:
        v = s.admit("t", SMALL, cost, now)
        if not isinstance(v, Verdict):
            v = loop.run_until_complete(v)  # type: ignore[arg-type]
        return v.admitted

    assert take(a, 1, 0.0) and a._tenants["t"].lease_t > 0
    first = a.registry.member
    loop.run_until_complete(b._beat(11.0))  # a missed every heartbeat for 11 s; b's heartbeat drops it
    assert b.registry.live == 1
    loop.run_until_complete(a._beat(12.0))
    assert a.registry.member != first and a.registry.member.startswith("a#")
    assert a._tenants["t"].lease_t == 0  # what the old member held is no longer a's
    assert take(a, 1, 12.0)
    loop.run_until_complete(b._beat(12.5))
    assert b.registry.live == 2


def test_shutdown_gives_the_lease_back(redis_server: RedisServer) -> None:
    async def main() -> RedisState:
        (s,) = replicas(redis_server.url, 1, "shut")
        assert (await admit(s, 10)).admitted
        assert s._tenants["t"].lease_t > 0
        return s

    s = asyncio.run(main())
    member = s.registry.member
    level_before = float(s._tenants["t"].level_t or 0)
    s.close()  # Runtime.close: blocking, the event loop may be gone
    import redis

    r = redis.Redis.from_url(redis_server.url)
    h = {k.decode(): float(v) for k, v in r.hgetall("shut:tb:t").items() if not k.startswith(b"x:")}
    assert h[f"g:{member}"] == h[f"s:{member}"]  # nothing leased any more
    assert h["tl"] >= level_before + 90  # the unused lease is back in the level
    assert r.zscore("shut:replicas", member) is None  # and the replica left the registry
    r.close()


def test_an_idle_tenants_lease_goes_back_and_is_not_renewed(
        loop_and_client: tuple[asyncio.AbstractEventLoop, Any]) -> None:
    loop, client = loop_and_client
    s = RedisState(client=client, replica_id="idle", prefix="idle", caller_clock=True, background=False,
                   lease_ttl_s=3.0, admit_wait_s=5.0)
    v = s.admit("t", SMALL, 5, 0.0)
    assert not isinstance(v, Verdict) and loop.run_until_complete(v).admitted  # type: ignore[arg-type]
    assert s._tenants["t"].lease_t > 0
    loop.run_until_complete(s.sync(1.0, only_due=True))  # not expiring yet: nothing sent
    assert s._tenants["t"].lease_t > 0
    loop.run_until_complete(s.sync(2.5, only_due=True))  # expiring, untouched: back, no new one
    assert s._tenants["t"].lease_t == 0
    loop.run_until_complete(s.sync(2.6, only_due=True))
    assert s._tenants["t"].lease_t == 0 and not s._tenants["t"].dirty()
