"""Breaker trips shared by replicas through Redis (extproc/store/shared_breakers.py), real redis-server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from bench.procs import free_port
from bench.redis_server import RedisServer
from extproc.backends.hold import Hold
from extproc.policy.breaker import Breaker, BreakerConfig, BreakerState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.schema import build_policy
from extproc.runtime.runtime import Runtime
from extproc.store import ENV_URL
from extproc.store.client import connect
from extproc.store.shared_breakers import SharedBreakers
from tests.backend_ops import try_acquire
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.test_pool import doc as pool_doc
from tests.waiting import eventually_async


def test_a_trip_on_one_replica_opens_the_others_once(redis_server: RedisServer) -> None:
    loop = asyncio.new_event_loop()
    client = connect(redis_server.url, socket_timeout_s=5.0)
    try:
        cfg = BreakerConfig(cooldown_s=5.0, consecutive_failures=3)
        a, b = Breaker(cfg, 0.0), Breaker(cfg, 0.0)
        sa, sb = SharedBreakers(client, lambda: "a#1", "sb"), SharedBreakers(client, lambda: "b#2", "sb")
        loop.run_until_complete(sa.sync({"sim": a}, 0.0))
        loop.run_until_complete(sb.sync({"sim": b}, 0.0))
        assert b.state(0.1) is BreakerState.CLOSED  # nothing published yet
        for _ in range(3):
            a.record_failure(1.0)
        assert a.state(1.0) is BreakerState.OPEN
        loop.run_until_complete(sa.sync({"sim": a}, 1.0))
        ttl = loop.run_until_complete(client.pttl("sb:breaker:sim"))
        assert 4000 < ttl <= 5000  # lives as long as a's cooldown
        loop.run_until_complete(sb.sync({"sim": b}, 1.2))
        assert b.state(1.2) is BreakerState.OPEN
        assert b.snapshot(1.2)["last_cause"] == "shared:consecutive_failures"
        # b's shared trip is not published back, and a does not trip on its own key
        loop.run_until_complete(sb.sync({"sim": b}, 1.4))
        loop.run_until_complete(sa.sync({"sim": a}, 1.4))
        assert (sa.published, sa.applied, sb.published, sb.applied) == (1, 0, 0, 1)
        assert a.snapshot(1.4)["trips"] == 1 and b.snapshot(1.4)["trips"] == 1
        # a breaker already recovering on its own is left to its own ramp
        c = Breaker(cfg, 0.0)
        c.trip(0.0, "backend_oom")
        sc = SharedBreakers(client, lambda: "c#3", "sb")
        loop.run_until_complete(sc.sync({"sim": c}, 1.5))
        assert c.snapshot(1.5)["trips"] == 1 and sc.applied == 0
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


def test_a_pool_endpoint_trip_on_one_runtime_ejects_it_on_the_other_within_a_second(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Runtimes on one Redis, each running its lease task (which syncs breakers every
    250 ms): endpoint B failing on replica 0 opens B on replica 1, which then places on A."""
    monkeypatch.delenv(ENV_URL, raising=False)
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    d = pool_doc([{"address": a, "kv_capacity_tokens": 4000}, {"address": b, "kv_capacity_tokens": 8000}],
                 breaker={"consecutive_failures": 2, "cooldown_s": 20.0})
    d["gateway"] = {"state": redis_server.url}

    async def main() -> tuple[float, dict[str, Any], list[Runtime]]:
        rts = [Runtime(build_policy(d), replica_id=f"ep{i}") for i in range(2)]
        for rt in rts:
            await rt.first_leases()
        tasks = [asyncio.create_task(rt.run_leases()) for rt in rts]
        try:
            eps0, eps1 = (rt.backends["pool"].endpoints for rt in rts)
            assert eps0 is not None and eps1 is not None
            def synced() -> list[int]:
                return [rt.shared_breakers.syncs for rt in rts]  # type: ignore[union-attr]

            await eventually_async(lambda: min(synced()) >= 1, 5, "both replicas synced their breakers once")
            # nothing is published yet
            assert eps1.by_key[b].breaker.state(rts[1].clock()) is BreakerState.CLOSED
            for _ in range(2):
                eps0.record(b, Outcome.FAILURE, None, rts[0].clock())
            assert eps0.by_key[b].breaker.state(rts[0].clock()) is BreakerState.OPEN
            t0 = time.monotonic()
            while eps1.by_key[b].breaker.state(rts[1].clock()) is not BreakerState.OPEN:
                assert time.monotonic() - t0 < 5.0, "the trip never reached the other replica"
                await asyncio.sleep(0.01)
            seen_after = time.monotonic() - t0
            before = synced()  # two more syncs each: the applied trip is not published back
            await eventually_async(lambda: all(n >= b + 2 for n, b in zip(synced(), before, strict=True)), 5,
                                   lambda: f"two more breaker syncs on each replica: {before} -> {synced()}")
            client = rts[0].state.client  # type: ignore[attr-defined]
            ttl = await client.pttl(f"sluice:breaker:pool@{b}")
            info = {"ttl": ttl, "stores": [rt.status()["store"]["breakers"] for rt in rts],
                    "snap1": eps1.by_key[b].breaker.snapshot(rts[1].clock()),
                    "a1": eps1.by_key[a].breaker.state(rts[1].clock()),
                    "pool1": rts[1].backends["pool"].breaker.state(rts[1].clock())}
            be1 = rts[1].backends["pool"]
            held = try_acquire(be1, "t", "a", None, 100, rts[1].clock())
            info["placed"] = held.endpoint if isinstance(held, Hold) else held
            if isinstance(held, Hold):
                be1.release(held, rts[1].clock())
            return seen_after, info, rts
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rt in rts:
                await rt.state.aclose()  # type: ignore[attr-defined]

    seen_after, info, rts = asyncio.run(main())
    assert seen_after < 1.0, seen_after  # one sync interval (250 ms) plus a round trip, on a loaded host
    assert 15000 < info["ttl"] <= 20000  # the key lives as long as replica 0's cooldown
    assert [(s["published"], s["applied"]) for s in info["stores"]] == [(1, 0), (0, 1)]
    assert info["snap1"]["last_cause"] == "shared:consecutive_failures" and info["snap1"]["trips"] == 1
    assert info["a1"] is BreakerState.CLOSED and info["pool1"] is BreakerState.CLOSED  # only B is ejected
    assert info["placed"] == a
    for rt in rts:
        rt.close()
