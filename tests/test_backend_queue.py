"""Queue deadlines on the runtime's clock: the tick expires a wait, no timer does.

The clock is a fake moved by assignment; nothing here sleeps to move time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.backends.hold import Hold
from extproc.backends.queue import Expired, Waiter
from extproc.backends.state import BackendState
from extproc.policy import kv as kvmath
from extproc.policy.schema import build_policy, hash_key
from extproc.request.admission import SlotWait, route
from extproc.request.refusal import Refusal
from extproc.runtime.runtime import Runtime
from extproc.service import ticker
from extproc.wire.peer import PeerStream
from tests.backend_ops import try_acquire
from tests.waiting import eventually_async


def policy(wait_ms: int = 60_000, depth: int = 4) -> Any:
    # A long max wait: a wait that ends within a test's real time was ended by the tick.
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 1,
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"priority": 1, "tpm": 100000, "rpm": 100, "max_queue_depth": depth,
                        "max_queue_wait_ms": wait_ms}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}],
    })


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def full_backend(p: Any) -> tuple[BackendState, Hold]:
    be = BackendState.create(p.backends[0], p, 0.0)
    be.has_metrics = False  # scale 1.0: no scraper in a unit test
    hold = try_acquire(be, "t", "a", None, 10, 0.0)
    assert isinstance(hold, Hold)
    return be, hold


def test_one_tick_past_the_deadline_expires_the_waiter() -> None:
    async def run() -> None:
        be, hold = full_backend(policy(wait_ms=1000))
        w = be.queue.enqueue("t", "a", None, 10, 5.0)
        assert isinstance(w, Waiter)
        assert be.queue.tick(5.999) == 0 and not w.future.done()  # before the deadline: still waiting
        assert be.queue.depth("t") == 1
        be.queue.tick(6.0)  # queued at 5.0 + 1 s
        assert w.future.done() and w.future.result() == Expired(1.0)
        assert be.queue.depth() == 0 and not be.waiters
        be.queue.leave(w)  # what _await_grant does next: nothing more to give back
        assert be.pool.in_use().total == 1  # only the first request's slot
        be.release(hold, 6.0)
        assert be.pool.in_use().total == 0 and be.kv_in_use == 0

    asyncio.run(run())


def test_a_freed_slot_beats_the_deadline_only_until_a_tick_has_expired_it() -> None:
    async def run() -> None:
        be, hold = full_backend(policy(wait_ms=1000))
        early = be.queue.enqueue("t", "a", None, 10, 0.0)
        late = be.queue.enqueue("t", "a", None, 10, 0.5)
        assert isinstance(early, Waiter) and isinstance(late, Waiter)
        be.queue.tick(1.2)  # early's deadline (1.0) passed; late's (1.5) not
        assert isinstance(early.future.result(), Expired) and not late.future.done()
        be.release(hold, 1.2)  # the freed slot goes to the one still waiting
        got = late.future.result()
        assert isinstance(got, Hold)
        be.release(got, 1.3)
        assert be.pool.in_use().total == 0 and be.queue.depth() == 0

    asyncio.run(run())


def test_a_reload_that_rebuilds_the_queue_keeps_when_each_waiter_was_queued() -> None:
    async def run() -> None:
        be, hold = full_backend(policy(wait_ms=1000))
        w = be.queue.enqueue("t", "a", None, 10, 0.0)
        assert isinstance(w, Waiter)
        p2 = policy(wait_ms=2000)
        be.reconfigure(p2.backends[0], p2, 1.5)  # another max wait: the queue is rebuilt at 1.5
        be.queue.tick(1.9)
        assert not w.future.done()
        be.queue.tick(2.0)  # queued at 0.0, the new max wait 2 s: not 1.5 + 2 s
        assert isinstance(w.future.result(), Expired)
        be.release(hold, 2.0)

    asyncio.run(run())


async def _silent_envoy(stop: asyncio.Event) -> AsyncIterator[pb.ProcessingRequest]:
    await stop.wait()  # Envoy sends nothing while a request waits; the client stays
    return
    yield


def test_admission_answers_queue_timeout_when_the_tick_sees_the_clock_past_the_deadline() -> None:
    clock = Clock()
    p = policy(wait_ms=60_000)
    rt = Runtime(p, clock=clock)

    async def run() -> None:
        stop = asyncio.Event()
        peer = PeerStream(_silent_envoy(stop))
        backend, model = p.by_model["m"]
        tenant = p.tenants["a"]
        tier = p.tiers[tenant.tier]
        slot = SlotWait(rt, tier, tenant.name, p.limits(tenant).max_concurrency, peer, lambda reason: False)
        first = route(rt, p, tier, tenant.name, backend, model, 10, clock())
        first.kv = kvmath.footprint(10, rt.backends["b"].kv_block_size)
        assert slot.acquire(first, clock()) is None and first.hold is not None
        ticket = route(rt, p, tier, tenant.name, backend, model, 10, clock())
        ticket.kv = first.kv
        assert slot.acquire(ticket, clock()) is not None  # the wait hint: it must queue
        started = time.monotonic()
        task = asyncio.create_task(slot.wait(ticket))
        await asyncio.sleep(0)
        be = rt.backends["b"]
        assert be.queue.depth("t") == 1
        clock.t += 59.9
        ticker.tick(rt)
        await asyncio.sleep(0)
        assert not task.done()
        clock.t += 0.1  # the deadline: 60 s on the runtime's clock, none of it slept
        ticker.tick(rt)
        with pytest.raises(Refusal) as err:
            await asyncio.wait_for(task, 5)
        assert time.monotonic() - started < 5  # the tick ended it, not a timer of 60 s
        rej = err.value
        assert rej.reason == "queue_timeout" and rej.code == "service_unavailable"
        assert rej.message == "Waited 60s for a free slot; the backend is saturated."
        assert int(rej.headers["retry-after"]) >= 1 and "retry-after-ms" in rej.headers
        assert ticket.hold is None and ticket.queued_s == pytest.approx(60.0)
        assert rt.metrics.registry.get_sample_value(
            "sluice_queue_wait_seconds_count", {"tier": "t", "result": "queue_timeout"}) == 1.0
        assert be.queue.depth() == 0 and not be.waiters and be.pool.in_use().total == 1
        be.release(first.hold, clock())
        assert be.pool.in_use().total == 0 and be.kv_in_use == 0
        stop.set()
        peer.cancel()

    try:
        asyncio.run(run())
    finally:
        rt.close()


def test_the_ticker_keeps_ticking_the_other_backends_when_one_fails() -> None:
    clock = Clock()
    p = policy(wait_ms=1000)
    rt = Runtime(p, clock=clock)

    class Broken:
        def tick(self, now: float) -> int:
            raise RuntimeError("a bug")

    async def run() -> None:
        be = rt.backends["b"]
        hold = try_acquire(be, "t", "a", None, 10, clock())
        assert isinstance(hold, Hold)
        w = be.queue.enqueue("t", "a", None, 10, clock())
        assert isinstance(w, Waiter)
        rt.backends = {"broken": Broken(), **rt.backends}  # type: ignore[dict-item]
        clock.t += 1.0
        ticker.tick(rt)
        assert isinstance(w.future.result(), Expired)
        be.release(hold, clock())

    try:
        asyncio.run(run())
    finally:
        rt.close()


def test_an_idle_ticker_wakes_on_the_first_enqueue_and_then_ticks_until_the_queue_is_empty() -> None:
    clock = Clock()
    p = policy(wait_ms=1000)
    rt = Runtime(p, clock=clock)

    async def run() -> None:
        be = rt.backends["b"]
        hold = try_acquire(be, "t", "a", None, 10, clock())
        assert isinstance(hold, Hold)
        # Idle, it would sleep a minute: only the enqueue's wake-up can make it tick in time.
        task = asyncio.create_task(ticker.run_ticker(rt, interval_s=0.01, idle_s=60))
        # The ticker hooks on_enqueue before it looks; seen from here, it has looked, found every
        # queue empty and waits for the wake-up (its only await while idle).
        await eventually_async(lambda: be.queue.on_enqueue is not None, 5, "the ticker found every queue empty")
        w = be.queue.enqueue("t", "a", None, 10, clock())
        assert isinstance(w, Waiter)
        clock.t += 1.0  # the deadline, on the runtime's clock
        got = await asyncio.wait_for(asyncio.shield(w.future), 5)
        assert isinstance(got, Expired) and be.queue.depth() == 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        be.release(hold, clock())

    try:
        asyncio.run(run())
    finally:
        rt.close()
