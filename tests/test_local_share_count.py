"""The replica count a local share divides by (``Registry.most_seen``), across outages, on a
real redis-server frozen with SIGSTOP: 3 replicas' TPM state stores and slot leases.

Redis frozen past the registry ttl loses every member; when it answers again the
replicas register one by one, so the first counts seen after the return are low. If it
goes down again within a ttl, each replica's local share must still be limit / 3, not
limit / (the replicas back so far). A replica truly gone lets the share grow back once
the store has answered for a ttl without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.redis_server import RedisServer
from extproc.policy.gate import Verdict
from extproc.policy.schema import Limits
from extproc.store.exchange import STORE_ERRORS
from extproc.store.redis_state import RedisState
from extproc.store.slot_leases import SlotLeases

TTL = 1.0  # the registry's and the slot leases' ttl, s
POOL = 12
LIM = Limits(tpm=60_000, rpm=1_000_000, burst_tokens=1000, max_concurrency=100)  # 1000 tokens/s


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()  # this test's own: it is frozen
    try:
        yield s
    finally:
        s.stop()


class Replica:
    def __init__(self, url: str, i: int) -> None:
        self.state = RedisState(url, replica_id=f"r{i}", prefix="share", background=False, registry_ttl_s=TTL,
                                lease_ttl_s=TTL, admit_wait_s=0.05, socket_timeout_s=0.1)
        self.slots = SlotLeases(self.state.client, self.state.registry, "share", ttl_s=TTL, timeout_s=0.1)
        self.wanted = (6, 2, 1)[i]  # slots in use: leases of 7, 3 and 2 (a block is 1)

    async def beat(self) -> bool:
        """One heartbeat as the background task runs it: an error or timeout trips the store."""
        s = self.state
        try:
            await asyncio.wait_for(s._beat(time.monotonic()), 0.2)
        except STORE_ERRORS as exc:
            s._trip(f"heartbeat: {type(exc).__name__}")
            return False
        s._answered()
        return True

    async def tick(self) -> int:
        await self.slots.tick({"b": (POOL, 0, self.wanted, 0)})
        return self.slots.leases["b"].slots

    async def tpm_share(self) -> float:
        """Admit on the local share (the store down): its refill rate, tokens/s."""
        assert not self.state.up
        v = self.state.admit("t", LIM, 10, time.monotonic())
        assert isinstance(v, Verdict)
        fb = self.state._tenants["t"].fallback
        assert fb is not None
        rate = fb[0].rate_per_s
        self.state._tenants["t"].fallback = None  # the next outage takes a new share
        return rate

    def seen(self) -> int | None:
        return self.state.registry.most_seen(time.monotonic())


async def _up(fleet: list[Replica]) -> None:
    for r in fleet:
        v = r.state.admit("t", LIM, 10, time.monotonic())
        if not isinstance(v, Verdict):
            v = await v
        assert v.admitted
    for _ in range(2):
        for r in fleet:
            assert await r.beat()
    assert [await r.tick() for r in fleet] == [7, 3, 2]
    assert [r.seen() for r in fleet] == [3, 3, 3]


async def _down(server: RedisServer, fleet: list[Replica]) -> None:
    server.pause()
    for r in fleet:
        assert not await r.beat()


async def _lose(server: RedisServer, fleet: list[Replica], how: str) -> None:
    """Redis away past the ttl, then back without the registry's members: killed and started
    empty, or frozen (the heartbeats sent meanwhile run when it resumes)."""
    if how == "killed":
        server.kill()
        for r in fleet:
            assert not await r.beat()
        await asyncio.sleep(1.2 * TTL)
        server.start()  # the same port, empty
        for r in fleet:  # its pooled connection died with the old server
            with contextlib.suppress(*STORE_ERRORS):
                await r.state.client.ping()
    else:
        await _down(server, fleet)
        await asyncio.sleep(1.5 * TTL)  # every member expires
        server.resume()


async def _close(server: RedisServer, fleet: list[Replica]) -> None:
    server.resume()
    for r in fleet:
        await r.state.aclose()
        await r.state.client.aclose()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_down_again_within_a_ttl_of_the_return_each_share_is_a_third(server: RedisServer, how: str) -> None:
    async def main() -> tuple[list[int | None], list[int], list[float], list[int | None]]:
        fleet = [Replica(server.url, i) for i in range(3)]
        try:
            await _up(fleet)
            await _lose(server, fleet, how)
            for r in fleet:  # one by one: the first sees 1, the next 2
                assert await r.beat()
            assert [r.state.registry.fences for r in fleet] == [1, 1, 1]
            await _down(server, fleet)  # again, within a ttl of the return
            await asyncio.sleep(TTL)  # past the slot leases' local deadline, and the ttl
            seen = [r.seen() for r in fleet]
            slots = [await r.tick() for r in fleet]
            rates = [await r.tpm_share() for r in fleet]
            await asyncio.sleep(TTL)  # the outage goes on: the count does not age
            later = [r.seen() for r in fleet]
            return seen, slots, rates, later
        finally:
            await _close(server, fleet)

    seen, slots, rates, later = asyncio.run(main())
    assert seen == [3, 3, 3], seen
    assert slots == [POOL // 3, 3, 2], slots  # 7 cut to the share; 3 and 2 within it
    assert rates == [pytest.approx(1000 / 3)] * 3, rates
    assert later == [3, 3, 3], later


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_replica_gone_for_a_ttl_lets_the_share_grow_back(server: RedisServer, how: str) -> None:
    async def main() -> tuple[list[int | None], list[int | None], list[int], list[float]]:
        fleet = [Replica(server.url, i) for i in range(3)]
        try:
            await _up(fleet)
            await _lose(server, fleet, how)
            a, b, _gone = fleet  # the third never comes back
            for r in (a, b):
                assert await r.beat()
            early = [r.seen() for r in (a, b)]  # within a ttl of the return: as before the loss
            # The store answers for two ttl: the third's member expires within one (frozen, the
            # heartbeat it sent meanwhile registered it again at the resume), its count the next.
            end = time.monotonic() + 2.3 * TTL
            while time.monotonic() < end:
                for r in (a, b):
                    assert await r.beat()
                await asyncio.sleep(TTL / 6)
            await _down(server, [a, b])
            await asyncio.sleep(TTL)
            late = [r.seen() for r in (a, b)]
            slots = [await r.tick() for r in (a, b)]
            rates = [await r.tpm_share() for r in (a, b)]
            return early, late, slots, rates
        finally:
            await _close(server, fleet)

    early, late, slots, rates = asyncio.run(main())
    assert early == [3, 3], early
    assert late == [2, 2], late
    assert slots == [POOL // 2, 3], slots
    assert rates == [pytest.approx(1000 / 2)] * 2, rates


def test_the_count_ages_only_while_the_store_answers() -> None:
    """The rule alone (``Registry.most_seen``), on a clock of its own."""
    from extproc.store.registry import Registry

    reg = Registry("r0", "share", 10.0)
    reg.observe(2, 99.0)
    reg.observe(3, 100.0)
    reg.down()
    assert reg.most_seen(100.5) == 3 and reg.most_seen(500.0) == 3  # the outage does not age it
    reg.observe(1, 500.0)  # back without the registry: the first to register again
    reg.observe(2, 500.05)
    assert reg.most_seen(500.1) == 3
    reg.down()  # down again within a ttl of the return
    assert reg.most_seen(900.0) == 3
    reg.observe(2, 900.0)
    assert reg.most_seen(900.0 + 9.0) == 3  # what was left of its ttl: the return's 0.05 s took some
    reg.observe(2, 900.0 + 10.0)
    assert reg.most_seen(900.0 + 10.0) == 2  # a ttl of answers without the third
