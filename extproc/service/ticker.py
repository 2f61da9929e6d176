"""The admission tick: ends queue waits at their deadline and pumps the queues.

While any request waits, each backend's ``tick`` (``extproc.backends.queue``) runs every
``TICK_S`` with the runtime's clock: waiters whose deadline (queued at + the tier's
``max_queue_wait_ms``) has passed get their 503 ``queue_timeout``, and capacity that
came back over time (a watermark recovering, a latency limit rising) goes to the
waiting requests. Freed slots reach waiters at once (a release pumps); only deadlines
and slow recoveries wait for the tick, so a queue timeout comes at most ``TICK_S``
(plus event-loop lag) late. With every queue empty the loop sleeps until an enqueue
wakes it (or ``IDLE_S``, for a backend added since it last looked), so an idle
extproc pays nothing for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.ticker")
TICK_S = 0.025
IDLE_S = 0.5


def tick(rt: Runtime) -> int:
    """One tick of every backend at the runtime's clock; returns how many waiters got a slot."""
    now = rt.clock()
    handed = 0
    for name, be in list(rt.backends.items()):
        try:
            handed += be.queue.tick(now)
        except Exception:  # noqa: BLE001 - one backend's bug must not stop the others' deadlines
            log.exception("admission tick of backend %s failed", name)
    return handed


async def run_ticker(rt: Runtime, interval_s: float = TICK_S, idle_s: float = IDLE_S) -> None:
    """Tick until cancelled: every ``interval_s`` while a request waits, else on the next enqueue."""
    wake = asyncio.Event()
    while True:
        wake.clear()
        for be in rt.backends.values():
            be.queue.on_enqueue = wake.set
        tick(rt)
        if any(be.queue.depth() for be in rt.backends.values()):
            await asyncio.sleep(interval_s)
        else:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop the cancel that
            # stops this loop when it lands as the wake-up does (extproc.store.slot_leases.wait)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(idle_s):
                    await wake.wait()
