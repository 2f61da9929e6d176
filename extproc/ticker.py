"""The admission tick: ends queue waits at their deadline and pumps the queues.

Every ``TICK_S`` each backend's ``tick`` (``extproc.backend_queue``) runs with the
runtime's clock: waiters whose deadline (queued at + the tier's ``max_queue_wait_ms``)
has passed get their 503 ``queue_timeout``, and capacity that came back over time (a
watermark recovering, a latency limit rising) goes to the waiting requests. Freed
slots reach waiters at once (a release pumps); only deadlines and slow recoveries wait
for the tick, so a queue timeout comes at most ``TICK_S`` (plus event-loop lag) late.
A tick with empty queues does nothing; measured idle cost: see README (``TICK_S``).
"""

from __future__ import annotations

import asyncio
import logging

from extproc.runtime import Runtime

log = logging.getLogger("sluice.ticker")
TICK_S = 0.025


def tick(rt: Runtime) -> int:
    """One tick of every backend at the runtime's clock; returns how many waiters got a slot."""
    now = rt.clock()
    handed = 0
    for name, be in list(rt.backends.items()):
        try:
            handed += be.tick(now)
        except Exception:  # noqa: BLE001 - one backend's bug must not stop the others' deadlines
            log.exception("admission tick of backend %s failed", name)
    return handed


async def run_ticker(rt: Runtime, interval_s: float = TICK_S) -> None:
    """Tick until cancelled."""
    while True:
        tick(rt)
        await asyncio.sleep(interval_s)
