"""An older slot-lease ask that Redis runs after a newer one of the same replica is ignored
(``SLOT_LEASE``'s sequence number, extproc/store/slot_leases.py ``exchange``), on a real
redis-server: a timed-out ask may still run, after the next one sent on another connection."""

from __future__ import annotations

import asyncio

import redis

from bench.redis_server import RedisServer
from extproc.store.client import connect
from extproc.store.registry import Registry
from extproc.store.slot_leases import SLOT_LEASE, SlotLeases
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture

POOL = 12


def test_an_ask_run_late_does_not_overwrite_the_newer_one(redis_server: RedisServer) -> None:
    async def main() -> tuple[list[int], str, int, list[int], str]:
        client = connect(redis_server.url, socket_timeout_s=2.0)
        try:
            regs = [Registry(f"r{i}", "order", 10.0) for i in range(2)]
            a, b = (SlotLeases(client, reg, "order", ttl_s=10.0, timeout_s=2.0) for reg in regs)
            for reg in regs:
                await reg.beat(client, "", 0.0)
            for sl in (a, b):
                sl.lease("p", POOL, 0)
            ls = a.leases["p"]
            late = a._args(a.registry.member, 3, 0, ls)  # sent first (a shrink to 3), run last
            assert (await a.exchange("p", 7, 0)).slots == 7  # the newer ask, answered
            script = client.register_script(SLOT_LEASE)
            stale = [int(x) for x in await script(keys=a.keys("p"), args=late)]
            held = (await client.hget("order:slots:p:held", a.registry.member)).decode()
            got_b = (await b.exchange("p", POOL, 0)).slots  # the others get what a does not hold
            # The same member name from another process (an epoch counter restarted from 0)
            # is not held to this one's numbers.
            other = [a.registry.member, 5, 0, POOL, 0, "10.0", "", 1, "another-process"]
            fresh = [int(x) for x in await script(keys=a.keys("p"), args=other)]
            after = (await client.hget("order:slots:p:held", a.registry.member)).decode()
            return stale, held, got_b, fresh, after
        finally:
            await client.aclose()

    stale, held, got_b, fresh, after = asyncio.run(main())
    assert stale[0] == -2, stale  # ignored
    assert held == "7 0", held  # without the number: "3 0", and b granted 9 of a's 7 (16 of 12)
    assert got_b == POOL - 7
    assert fresh[0] == 5 and after == "5 0", (fresh, after)


def test_the_asks_of_members_gone_are_forgotten(redis_server: RedisServer) -> None:
    sync = redis.Redis.from_url(redis_server.url)

    async def main() -> list[str]:
        client = connect(redis_server.url, socket_timeout_s=2.0)
        try:
            regs = [Registry(f"r{i}", "forget", 10.0) for i in range(2)]
            a, b = (SlotLeases(client, reg, "forget", ttl_s=10.0, timeout_s=2.0) for reg in regs)
            for reg, sl in zip(regs, (a, b), strict=True):
                await reg.beat(client, "", 0.0)
                sl.lease("p", POOL, 0)
                await sl.exchange("p", 2, 0)
            await client.zrem(regs[1].keys[0], regs[1].member)  # b's member gone (expired)
            before = sorted(k.decode() for k in sync.hkeys("forget:slots:p:seq"))
            await a.exchange("p", 2, 0)
            after = sorted(k.decode() for k in sync.hkeys("forget:slots:p:seq"))
            return before, after, sorted(r.member for r in regs), a.registry.member
        finally:
            await client.aclose()

    try:
        before, after, members, kept = asyncio.run(main())
    finally:
        sync.close()
    assert before == members and after == [kept], (before, after)
