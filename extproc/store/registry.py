"""Which replicas are alive: a sorted set scored by Redis-time deadlines.

Each replica registers once (its member is ``<replica id>#<epoch>``, the epoch from
``INCR``) and renews every ttl/3. A member not renewed within the ttl is dropped by
the next heartbeat of anyone; the replica it belonged to is fenced: its next
heartbeat registers it again under a new epoch, and what it held under the old
member (leases) is no longer its. Registering is idempotent per process (``token``):
a heartbeat whose answer was lost may have registered a member, and the retry gets it.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from typing import Any

from extproc.store.scripts import HEARTBEAT

log = logging.getLogger("sluice.store")


class Registry:
    def __init__(self, replica_id: str, prefix: str, ttl_s: float = 10.0) -> None:
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.keys = [f"{prefix}:replicas", f"{prefix}:epoch", f"{prefix}:replicas:tokens"]
        self.token = secrets.token_hex(8)  # this process's: a retried registration is not a second one
        self.member = ""
        self.live = 1
        # replicas registered at the last heartbeat that found this one alive (not fenced), or
        # more seen since: how many to wait for when Redis comes back without the leases
        # (slot_leases). Within a ttl of a fence it only rises: the others register again
        # one by one, and a count of those back so far is not how many there are.
        self.steady = 1
        self.fences = 0  # heartbeats that found this replica fenced (its member gone)
        self.fenced_at = -float("inf")  # local time of the last of them
        self.beat_at = -float("inf")  # local time of the last successful heartbeat
        # (when, count) of every count seen, "when" on a clock that stops while the store is down
        # (local time less the outages): counts age only while the store answers (most_seen)
        self._seen: deque[tuple[float, int]] = deque()
        self._answer_at = -float("inf")  # local time of the last answer
        self._down_at: float | None = None  # the last answer before the store was found down
        self._paused = 0.0  # local time spent with the store down, up to the last answer

    def due(self, now: float) -> bool:
        return now - self.beat_at >= self.ttl_s / 3

    def args(self, script_now: str) -> list[str]:
        return [self.replica_id, self.member, repr(self.ttl_s), script_now, self.token]

    def record(self, reply: list[Any], now: float) -> bool:
        """Take a heartbeat's reply; True when this replica was fenced (its old member expired)."""
        member, live, fenced = reply
        self.member = member.decode() if isinstance(member, bytes) else str(member)
        self.live = max(1, int(live))
        self.beat_at = now
        self.observe(self.live, now)
        if int(fenced):
            self.fences += 1
            self.fenced_at = now
        elif now - self.fenced_at < self.ttl_s:
            self.steady = max(self.steady, self.live)
        else:
            self.steady = self.live
        if int(fenced):
            log.warning("state store: replica %s was fenced (its registration expired or Redis lost it); "
                        "registered again as %s", self.replica_id, self.member)
        return bool(int(fenced))

    def observe(self, live: int, now: float) -> None:
        """A live count that came back with an exchange (or a heartbeat)."""
        self.live = max(1, live)
        if self._down_at is not None:  # the first answer after an outage: it did not age the counts
            self._paused += max(0.0, now - self._down_at)
            self._down_at = None
        self._answer_at = max(self._answer_at, now)
        up = self._answer_at - self._paused
        self._seen.append((up, self.live))
        while self._seen and self._seen[0][0] < up - self.ttl_s:
            self._seen.popleft()

    def down(self) -> None:
        """The store did not answer (its breaker tripped, or a lease exchange failed)."""
        if self._down_at is None and self._seen:
            self._down_at = self._answer_at

    def most_seen(self, now: float) -> int | None:
        """The largest replica count seen in the last ttl the store answered (None before the
        first answer).

        Not the last ttl of local time: Redis back without the registry's members (restarted
        empty, or frozen past the ttl) counts the replicas as they register again, one by one
        (the first back sees 1), and a store down again within a ttl of that must still
        divide by the count from before the loss. While the store is down the window stands
        still (its ttl up to the last answer); after the return the counts from before the
        outage stay for what was left of their ttl. A replica truly gone leaves the count
        once the store has answered for a ttl without it (its member expires within a ttl,
        then the counts with it age out: two ttl of answers at most)."""
        if not self._seen:
            return None
        up = (self._down_at if self._down_at is not None else max(now, self._answer_at)) - self._paused
        recent = [n for t, n in self._seen if t >= up - self.ttl_s]
        return max(recent) if recent else self._seen[-1][1]  # no answer for a ttl, none missed: the last

    async def beat(self, client: Any, script_now: str, now: float) -> bool:
        reply = await client.eval(HEARTBEAT, len(self.keys), *self.keys, *self.args(script_now))
        return self.record(reply, now)
