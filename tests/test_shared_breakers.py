"""Breaker trips shared by replicas through Redis (extproc/store/shared_breakers.py), real redis-server."""

from __future__ import annotations

import asyncio

from bench.redis_server import RedisServer
from extproc.policy.breaker import Breaker, BreakerConfig, BreakerState
from extproc.store.redis_state import connect
from extproc.store.shared_breakers import SharedBreakers
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture


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
