"""BackendState: slots + KV footprint + the fair queue, driven through random interleavings."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.backends.hold import Hold
from extproc.backends.queue import Waiter
from extproc.backends.state import BackendState
from extproc.policy import kv as kvmath
from extproc.policy.schema import build_policy, hash_key
from extproc.policy.slots import Denied
from tests.backend_ops import try_acquire


def make_policy(kv: int | None = 1000, total: int = 4) -> Any:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": total,
                      **({"kv_capacity_tokens": kv} if kv else {}), "kv_block_size": 10,
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"hi": {"priority": 10, "tpm": 1000, "rpm": 10, "guaranteed_slots": 1, "max_queue_depth": 3,
                         "max_queue_wait_ms": 1000, "queue_weight": 3},
                  "lo": {"priority": 1, "tpm": 1000, "rpm": 10, "max_queue_depth": 3, "max_queue_wait_ms": 1000}},
        "tenants": [{"name": "a", "tier": "hi", "keys": [hash_key("a")]},
                    {"name": "z", "tier": "lo", "keys": [hash_key("z")]}],
    })


def runtime(**kw: Any) -> BackendState:
    p = make_policy(**kw)
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False  # scale 1.0: no scraper in a unit test
    return be


def test_footprint_rounds_to_blocks() -> None:
    be = runtime()
    assert (
        kvmath.footprint(1, be.kv_block_size) == 10
        and kvmath.footprint(10, be.kv_block_size) == 10
        and kvmath.footprint(11, be.kv_block_size) == 20
    )


def test_kv_budget_refuses_overcommit_but_a_lone_request_fits() -> None:
    be = runtime(kv=100)
    first = try_acquire(be, "hi", "a", None, 60, 0.0)
    assert isinstance(first, Hold)
    second = try_acquire(be, "hi", "a", None, 60, 0.0)
    assert isinstance(second, Denied) and second.reason == "kv_exhausted"
    be.release(first, 0.0)
    assert be.kv_in_use == 0
    assert isinstance(try_acquire(be, "lo", "z", None, 100, 0.0), Hold)


def test_scaled_budget_still_admits_one_request_when_idle() -> None:
    be = runtime(kv=100)
    be.has_metrics = True  # no sample yet: the watermark controller says "floor"
    assert kvmath.kv_budget(be, 0.0) < 100
    assert isinstance(try_acquire(be, "hi", "a", None, 100, 0.0), Hold)


def test_queued_request_gets_the_released_capacity() -> None:
    async def run() -> None:
        be = runtime(kv=100)
        h = try_acquire(be, "hi", "a", None, 100, 0.0)
        assert isinstance(h, Hold)
        w = be.queue.enqueue("lo", "z", None, 50, 0.0)
        assert isinstance(w, Waiter)
        # A newcomer of the same tier may not overtake the waiter.
        assert isinstance(try_acquire(be, "lo", "z", None, 10, 0.0), Denied)
        be.release(h, 0.0)
        got = await asyncio.wait_for(w.future, 1)
        assert isinstance(got, Hold) and be.kv_in_use == 50
        be.release(got, 0.0)
        assert be.kv_in_use == 0 and be.pool.in_use().total == 0

    asyncio.run(run())


def test_leaving_after_the_grant_returns_it() -> None:
    async def run() -> None:
        be = runtime(kv=100)
        h = try_acquire(be, "hi", "a", None, 100, 0.0)
        assert isinstance(h, Hold)
        w = be.queue.enqueue("hi", "a", None, 100, 0.0)
        assert isinstance(w, Waiter)
        be.release(h, 0.0)  # hands the capacity to the waiter...
        assert w.future.done()
        be.queue.leave(w)  # ...which has just given up: the grant must come back
        assert be.kv_in_use == 0 and be.pool.in_use().total == 0

    asyncio.run(run())


ops = st.lists(st.tuples(st.sampled_from(["acquire", "enqueue", "release", "leave", "pump", "policy"]),
                         st.sampled_from(["hi", "lo"]), st.integers(1, 120), st.integers(0, 1000)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_no_interleaving_leaks_a_slot_or_kv(seq: list[tuple[str, str, int, int]]) -> None:
    async def run() -> None:
        be = runtime(kv=300, total=3)
        holds: list[Hold] = []
        waiters: list[Waiter] = []
        for op, tier, kv, pick in seq:
            tenant = "a" if tier == "hi" else "z"
            if op == "acquire":
                got = try_acquire(be, tier, tenant, 2, kv, 0.0)
                if isinstance(got, Hold):
                    holds.append(got)
            elif op == "enqueue":
                w = be.queue.enqueue(tier, tenant, 2, kv, 0.0)
                if isinstance(w, Waiter):
                    waiters.append(w)
            elif op == "release" and holds:
                be.release(holds.pop(pick % len(holds)), 0.0)
            elif op == "leave" and waiters:
                be.queue.leave(waiters.pop(pick % len(waiters)))
            elif op == "pump":
                be.queue.pump(0.0)
            elif op == "policy":
                p = make_policy(kv=300, total=1 + pick % 4)
                be.reconfigure(p.backends[0], p, 0.0)
            # Collect grants handed to waiters: their owners now hold them.
            for w in [w for w in waiters if w.future.done()]:
                waiters.remove(w)
                res = w.future.result()
                if isinstance(res, Hold):
                    holds.append(res)
            assert be.kv_in_use == sum(h.kv for h in holds)
            assert be.pool.in_use().total == len(holds)
            assert be.kv_in_use <= 300 or len(holds) == 1
        for w in waiters:
            be.queue.leave(w)
        for h in holds:
            be.release(h, 0.0)
        assert be.kv_in_use == 0
        assert be.pool.in_use().total == 0
        assert be.queue.depth() == 0 and not be.waiters

    asyncio.run(run())


def test_small_low_tier_requests_cannot_starve_a_large_premium_waiter() -> None:
    async def run() -> None:
        be = runtime(kv=1000, total=8)
        a = try_acquire(be, "hi", "a", None, 500, 0.0)
        b = try_acquire(be, "hi", "a", None, 400, 0.0)
        assert isinstance(a, Hold) and isinstance(b, Hold)
        big = be.queue.enqueue("hi", "a", None, 600, 0.0)  # needs 600; only 100 free
        assert isinstance(big, Waiter)
        # A small free-tier request would fit in the 100 left, but that room is owed upward.
        assert isinstance(try_acquire(be, "lo", "z", None, 50, 0.0), Denied)
        be.release(a, 0.0)  # 600 free now: it goes to the premium waiter, not to newcomers
        got = await asyncio.wait_for(big.future, 1)
        assert isinstance(got, Hold)
        # Nobody is owed anything now: the next free room goes to whoever fits.
        be.release(b, 0.0)
        small = try_acquire(be, "lo", "z", None, 50, 0.0)
        assert isinstance(small, Hold)
        be.release(got, 0.0)
        be.release(small, 0.0)
        assert be.kv_in_use == 0

    asyncio.run(run())


def test_a_waiting_premium_request_is_pressure_for_lower_tiers() -> None:
    async def run() -> None:
        be = runtime(kv=100)
        assert kvmath.pressure_scale(be, "lo", 0.0) == 1.0
        h = try_acquire(be, "hi", "a", None, 100, 0.0)
        assert isinstance(h, Hold)
        w = be.queue.enqueue("hi", "a", None, 100, 0.0)
        assert isinstance(w, Waiter)
        floor = be.spec.watermark.floor
        assert kvmath.pressure_scale(be, "lo", 0.0) == floor  # lower tiers degrade or shed now
        assert kvmath.pressure_scale(be, "hi", 0.0) == 1.0  # the waiting tier itself is not degraded
        be.release(h, 0.0)
        got = await asyncio.wait_for(w.future, 1)
        assert kvmath.pressure_scale(be, "lo", 0.0) == 1.0
        assert isinstance(got, Hold)
        be.release(got, 0.0)

    asyncio.run(run())


def test_overcommit_admits_more_reservations_than_the_cache() -> None:
    p = build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 8, "kv_capacity_tokens": 100,
                      "kv_block_size": 10, "kv_overcommit": 1.5, "models": [{"name": "m", "context_window": 64}]}],
        "tiers": {"hi": {"tpm": 1000, "rpm": 10}},
        "tenants": [{"name": "a", "tier": "hi", "keys": [hash_key("a")]}],
    })
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False
    holds = [try_acquire(be, "hi", "a", None, 50, 0.0) for _ in range(3)]
    assert all(isinstance(h, Hold) for h in holds)  # 150 reserved on a 100-token cache
    assert isinstance(try_acquire(be, "hi", "a", None, 10, 0.0), Denied)
