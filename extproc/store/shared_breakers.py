"""Breaker trips shared by replicas: one Redis key per breaker, living as long as the cooldown.

A breaker that trips on its own evidence (``consecutive_failures``, ``error_ratio``,
an OOM, ...) is published as ``<prefix>:breaker:<backend>`` (``/<model>`` for a
route's breaker, ``@<host:port>`` for a pool endpoint's) with the value ``<member> <trips>
<cause>`` and an expiry of its
cooldown. Every replica reads all its breakers' keys in one ``MGET`` per ``sync``
(every 250 ms, from the lease task): a key it has not applied yet trips its own
closed breaker, with the cause ``shared:<cause>``, which is never published again.
So a trip seen by one replica is seen by all within two sync intervals (the
publisher's, then the reader's) plus round trips; each replica then runs its own cooldown and half-open ramp (the pure
``Breaker`` is unchanged). Manual overrides reach every replica through the policy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from extproc.policy.breaker import Breaker, BreakerState

log = logging.getLogger("sluice.store")

SHARED = "shared:"


class SharedBreakers:
    def __init__(self, client: Any, member: Any, prefix: str = "sluice", timeout_s: float = 0.1) -> None:
        self.client, self.prefix, self.timeout_s = client, prefix, timeout_s
        self.member = member  # a callable returning this replica's registry member
        self._trips: dict[str, int] = {}  # breaker key -> trips already published or seen
        self._applied: dict[str, str] = {}  # breaker key -> the published value already applied
        self.published = 0
        self.applied = 0
        self.syncs = 0  # finished: the sync loop is alive (and a waiter can count rounds)

    def key(self, name: str) -> str:
        return f"{self.prefix}:breaker:{name}"

    async def sync(self, breakers: dict[str, Breaker], now: float) -> None:
        """Publish this replica's new trips, then apply the others' (one MGET, a SET per new trip)."""
        pipe = self.client.pipeline(transaction=False)
        publish = False
        for name, b in breakers.items():
            snap = b.snapshot(now)
            trips, cause = int(snap["trips"]), str(snap["last_cause"] or "")
            seen = self._trips.setdefault(name, trips)
            if trips > seen and snap["automatic_state"] == BreakerState.OPEN and not cause.startswith(SHARED):
                ttl_ms = max(1, int(float(snap["cooldown_left_s"]) * 1000))
                value = f"{self.member()} {trips} {cause}"
                pipe.set(self.key(name), value, px=ttl_ms)
                self._applied[name] = value  # our own
                publish = True
                self.published += 1
            self._trips[name] = trips
        names = list(breakers)
        # asyncio.timeout, not wait_for: this runs inside run_leases, which is cancelled to
        # stop (see SlotLeases.wait)
        if publish:
            async with asyncio.timeout(self.timeout_s):
                await pipe.execute()
        if not names:
            self.syncs += 1
            return
        async with asyncio.timeout(self.timeout_s):
            values = await self.client.mget([self.key(n) for n in names])
        for name, raw in zip(names, values, strict=True):
            if raw is None:
                continue
            value = raw.decode() if isinstance(raw, bytes) else str(raw)
            if self._applied.get(name) == value:
                continue
            self._applied[name] = value
            b = breakers[name]
            if b.state(now) is not BreakerState.CLOSED:
                continue  # open or ramping on its own: its own cooldown stands
            cause = value.split(" ", 2)[2] if value.count(" ") >= 2 else "trip"
            if b.trip(now, SHARED + cause):
                self._trips[name] = int(b.snapshot(now)["trips"])
                self.applied += 1
                log.warning("breaker %s: tripped by another replica (%s); open here too", name, value)
        self.syncs += 1

    def snapshot(self) -> dict[str, int]:
        return {"published": self.published, "applied": self.applied, "syncs": self.syncs}
