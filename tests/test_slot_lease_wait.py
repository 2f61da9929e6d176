"""Waiting for the lease check a refusal woke (SlotLeases.next_check, admission's lease wait)
and stopping the lease task: on a real redis-server where a Runtime runs its leases."""

from __future__ import annotations

import asyncio

import pytest

from bench.redis_server import RedisServer
from extproc.backends.hold import Hold
from extproc.policy.admit import SlotRequest
from extproc.policy.decision import Reject
from extproc.store import ENV_URL
from extproc.store.slot_leases import SlotLeases
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.test_slot_leases import _doc, _replicas, _stop
from tests.waiting import eventually_async


class NoScripts:
    """A client for SlotLeases whose checks the test runs by hand (begin_check, end_check)."""

    def register_script(self, _src: str) -> None:
        return None


def test_a_lease_waiter_is_woken_by_the_check_that_read_its_refusal_not_by_one_begun_before() -> None:
    """A check already running when a request is refused may not have read the refusal;
    a check that has read it wakes the request (the one after would shrink the lease again)."""

    async def scenario() -> list[str]:
        leases = SlotLeases(NoScripts(), registry=None)  # type: ignore[arg-type]
        woke: list[str] = []
        early = leases.begin_check()  # a check is running before the refusal
        leases.want_more("sim", 1, 224)

        async def waiter() -> None:
            await leases.next_check(5.0)
            woke.append("waiter")

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        leases.end_check(early)
        await asyncio.sleep(0)
        woke.append("after early check")
        seen = leases.begin_check()  # this one reads the refusal
        leases.end_check(seen)
        await task
        return woke

    assert asyncio.run(scenario()) == ["after early check", "waiter"]


def test_a_lease_waiter_is_woken_by_the_check_that_read_its_refusal_even_if_it_ended_before_the_wait() -> None:
    """The refused stream sends Envoy a hint before it awaits; meanwhile the check its refusal
    woke may read the refusal, grow the lease and end. That check still wakes it: the wait is
    registered at the refusal. Waiting for the next check instead would retry after that one
    shrank the lease again (the refusal no longer pending): refused with room in the pool."""

    async def scenario() -> tuple[bool, bool]:
        leases = SlotLeases(NoScripts(), registry=None)  # type: ignore[arg-type]
        leases.want_more("sim", 1, 224)  # the refusal, and in the same step the wait
        checked = leases.next_check(5.0)
        seen = leases.begin_check()
        leases.end_check(seen)  # the check that read it has ended before the stream awaits
        done_at_once = checked.done()
        await checked
        # With no check at all, the wait ends at its bound.
        bounded = leases.next_check(0.01)
        leases.want_more("sim", 1, 224)
        await asyncio.wait_for(bounded, 5.0)
        return done_at_once, bounded.done()

    assert asyncio.run(scenario()) == (True, True)


def test_a_false_alarm_of_the_token_store_does_not_skip_the_lease_wait(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token store's breaker opens on a bucket exchange slower than 8 ms, which a busy host
    makes without any outage. The lease exchanges still answer: a request short of KV waits for
    the check its refusal woke and fits the lease that check grew."""
    monkeypatch.delenv(ENV_URL, raising=False)
    doc = _doc(redis_server.url, {"name": "kv", "address": "127.0.0.1:1", "max_concurrency": 8,
                                  "kv_capacity_tokens": 4000})

    async def main() -> tuple[bool, bool, int, int, bool]:
        rts, tasks = await _replicas(doc, 1, "alarm")
        rt = rts[0]
        be = rt.backends["kv"]
        assert rt.slot_leases is not None and be.lease_wait is not None
        rt.state.breaker.trip("no answer within 8 ms")  # type: ignore[attr-defined]
        held = rt.slot_leases.leases["kv"].kv
        req = SlotRequest("t", "a", None, held + 100, may_queue=False)  # beyond the lease, within the pool
        refused = isinstance(be.acquire(req, rt.clock()), Reject)
        checked = be.lease_wait()  # as admission calls it, at the refusal
        waits = not checked.done()
        await asyncio.wait_for(checked, 5.0)
        got = be.acquire(req, rt.clock())
        grown = rt.slot_leases.leases["kv"].kv
        if isinstance(got, Hold):
            be.release(got, rt.clock())
        await _stop(rts, tasks)
        return refused, waits, held, grown, isinstance(got, Hold)

    refused, waits, held, grown, admitted = asyncio.run(main())
    assert refused and waits, (refused, waits)
    assert grown >= held + 100 and admitted, (held, grown)


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_the_lease_loop_cancelled_as_a_poke_wakes_it_stops(turns: int) -> None:
    """run_leases stops by being cancelled; a cancel that lands as a poke wakes its wait must
    not be dropped (with Python 3.11's asyncio.wait_for it was: the loop went on for ever and
    whoever awaited the cancelled task hung)."""

    async def scenario() -> tuple[bool, bool]:
        leases = SlotLeases(NoScripts(), registry=None)  # type: ignore[arg-type]
        leases.check_s = 60.0

        async def loop() -> None:  # as run_leases waits between its checks
            while True:
                await leases.wait()

        task = asyncio.ensure_future(loop())
        await asyncio.sleep(0)  # waiting for a poke
        leases.poke()
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)  # a bound for a task that would run for ever
        return task.done(), task.done() and task.cancelled()

    assert asyncio.run(scenario()) == (True, True)


def test_the_lease_task_stops_when_a_library_loses_its_cancel(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py awaits asyncio.wait_for, which in Python 3.11 returns a result that comes in
    with a cancel instead of raising it; run_leases must stop all the same (it looped on for
    ever, and _stop here hung, when a release's poke and the cancel met)."""
    monkeypatch.delenv(ENV_URL, raising=False)
    doc = _doc(redis_server.url, {"name": "lost", "address": "127.0.0.1:1", "max_concurrency": 8})

    async def main() -> bool:
        rts, tasks = await _replicas(doc, 1, "lost")
        rt = rts[0]
        ticking, dropped = asyncio.Event(), asyncio.Event()

        async def tick_losing_the_cancel() -> int:
            ticking.set()
            try:
                await asyncio.sleep(1.0)  # a round trip to Redis, in which the cancel lands
            except asyncio.CancelledError:
                if dropped.is_set():
                    raise  # only the first is lost (so that a regression fails, not hangs)
                dropped.set()  # lost: the result is returned, as 3.11's wait_for does
            return 0

        rt.lease_tick = tick_losing_the_cancel  # type: ignore[method-assign]
        await eventually_async(lambda: rt.slot_leases is not None and rt.slot_leases.leases, 5, "a lease")
        ticking.clear()
        rt.slot_leases.poke()  # type: ignore[union-attr]
        await ticking.wait()  # cancelled inside a tick, in its round trip to Redis
        tasks[0].cancel()
        await asyncio.wait(tasks, timeout=5.0)
        stopped = tasks[0].done()
        await _stop(rts, tasks)
        return stopped and dropped.is_set()

    assert asyncio.run(main())
