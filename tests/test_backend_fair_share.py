"""BackendState: fair share by work among a tier's tenants, with the queue and peer headroom."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.admit import SlotRequest
from extproc.policy.decision import Queue
from extproc.policy.fair_share import work
from extproc.policy.schema import build_policy, hash_key


def backend() -> BackendState:
    p = build_policy(
        {
            "backends": [
                {
                    "name": "b",
                    "address": "127.0.0.1:1",
                    "max_concurrency": 64,
                    "kv_capacity_tokens": 10_000,
                    "kv_block_size": 10,
                    "models": [{"name": "m", "context_window": 4096}],
                }
            ],
            "tiers": {
                "free": {
                    "priority": 1,
                    "tpm": 10**6,
                    "rpm": 10**4,
                    "max_queue_depth": 64,
                    "max_queue_wait_ms": 10_000,
                }
            },
            "tenants": [
                {"name": n, "tier": "free", "keys": [hash_key(n)]} for n in ("heavy", "light")
            ],
        }
    )
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False
    return be


def ask(be: BackendState, tenant: str, kv: int, out: int, now: float) -> Hold | Queue:
    got = be.acquire(SlotRequest("free", tenant, None, kv, work=work(kv - out, out)), now)
    assert isinstance(got, Hold | Queue), got
    return got


def test_a_light_tenant_is_not_kept_waiting_by_a_heavy_one_filling_the_cache() -> None:
    async def go() -> Any:
        be = backend()
        light = ask(be, "light", 2000, 100, 0.0)  # light has been here: its demand is known (2,000)
        assert isinstance(light, Hold)
        held = [ask(be, "heavy", 3000, 200, 0.1), ask(be, "heavy", 3000, 200, 0.1)]
        assert all(isinstance(h, Hold) for h in held)  # 8,000 held; 1.5 x light's 2,000 is kept
        for _ in range(8):  # the rest of heavy's flood waits
            assert isinstance(ask(be, "heavy", 3000, 200, 0.2), Queue)
            be.queue.enqueue("free", "heavy", None, 3000, 0.2, work=work(2800, 200))
        be.release(light, 1.0)
        # Heavy's next (3,000) would fit the 4,000 free now, but it is what light needs: it
        # stays free.
        assert be.kv_in_use == 6000 and be.queue.depth("free") == 8
        assert isinstance(
            ask(be, "light", 3000, 100, 1.1), Hold
        )  # light goes at once, past the queue
        st = be.status(1.1)["fair_share"]["free"]
        assert st["backlogged"] == 1

    asyncio.run(go())


def test_heavy_gets_the_room_light_does_not_need() -> None:
    async def go() -> Any:
        be = backend()
        got = [ask(be, "heavy", 3200, 200, 0.0) for _ in range(3)]
        assert all(isinstance(h, Hold) for h in got)  # light never seen: nothing kept for it

    asyncio.run(go())


def test_a_blocked_head_over_its_share_does_not_hold_a_light_tenants_turn() -> None:
    async def go() -> Any:
        be = backend()
        be.queue.order.charge(
            "free", "light", 50_000.0, 0.0
        )  # light was given more: the counters pick heavy
        held = [
            ask(be, "heavy", 3000, 200, 0.0) for _ in range(3)
        ]  # 9,000 of 10,000: over a half share
        assert all(isinstance(h, Hold) for h in held)
        big = be.queue.enqueue("free", "heavy", None, 3000, 0.1, work=work(2800, 200))
        small = be.queue.enqueue("free", "light", None, 500, 0.2, work=work(400, 100))
        assert not isinstance(big, str) and not isinstance(small, str)
        assert be.queue.order.head("free") == big.id  # heavy's turn, but 3,000 does not fit
        be.queue.tick(0.3)
        assert small.future.done() and isinstance(small.future.result(), Hold)  # light went past it
        assert not big.future.done()
        h = held[0]
        assert isinstance(h, Hold)
        be.release(h, 0.4)
        assert big.future.done() and isinstance(
            big.future.result(), Hold
        )  # and heavy's head when room came

    asyncio.run(go())
