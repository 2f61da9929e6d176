"""Slot leases after Redis lost them: claims, caps and reports (``extproc.store.slot_leases``).

Redis back without the leases (restarted empty, or frozen past the ttl so that every
member expired): each replica finds itself fenced, by an exchange (granted -1) or by
its heartbeat (``Registry.fences``; an epoch counter restarted from 0 may hand out the
same member name again, so the name is not what tells; the fence is looked for before
each lease of a check). At the first sign it takes a *claim* per lease, what it holds
then (before the fence zeroes it), and until the claim is lifted it asks for no more
than that, or than what its requests in flight hold where that is more (a lease cut to
the local share may have more running than it holds). A pool's claim is lifted when an
exchange on it shows that every registered replica has reported on the pool
(``KEYS[4]`` of ``SLOT_LEASE``, each member's last exchange, a grant of 0 included; an exchange that
finds the replica fenced reports nothing) and that at least as many have as were
registered before the loss (``Registry.steady``, the count at the last unfenced
heartbeat, or more seen since; within a ttl of a fence it only rises, as the replicas
register again one by one; a heartbeat whose answer the replica never got registers
no second member for it, ``scripts.HEARTBEAT``); or when
``recover_s`` (ttl/2) has passed: a replica seen before that has not registered again
by then is taken as gone (a running replica that reaches Redis heartbeats every ttl/3,
so it registers again within ttl/3 of the loss and reports at its next check,
``check_s`` later). A capped lease that wants more exchanges every check, so the lift
is seen within ``check_s``.

Why the pool is not exceeded: call what a replica occupies on a pool the larger of its
lease and what it has in use there. Before the loss, every local lease ≤ what Redis
recorded for it (it shrinks locally before it is sent, grows only when Redis answers),
what is in use ≤ the lease (a lease never shrinks below it), and Redis's records sum
to ≤ the pool. While Redis cannot be reached a lease only shrinks (to the local share)
and nothing is admitted beyond it, so what each replica occupies only shrinks. So the
caps (claim or in use, whichever is more: at most what the replica occupied at the
first sign) sum to ≤ the pool. Until every replica has reported, each asks for ≤ its
cap and ≥ what it has in use (a lease is never asked below it), and Redis grants
``min(ask, pool − the others' records)``, the others' records ≤ their caps: so ≥ what
it has in use. The records then cover every request running and sum to ≤ the pool.
Once every replica has reported, Redis's records cover every lease held and every
request in flight, and the script's rule (grant ≤ pool − what the others hold) keeps
the sum ≤ the pool as before. (Taking the claim from the lease alone, a replica whose
requests outlived its cut lease, or that claimed again after a wrongly lifted claim,
left room in Redis that its requests still used: 13 of 12 after a freeze through
Envoy.) The exceptions: requests in flight beyond a lease fenced while the others
reached Redis (they finish; the lease admits nothing new until in use is below it),
and a replica that is alive but registers again only after ``recover_s``
(paused, or cut off from Redis that long), which may find its room taken: it holds then
what it was granted plus its requests in flight. Admission does not wait for the lift:
a replica admits within its claim as soon as its own lease is granted again.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.store.pool_lease import PoolLease
    from extproc.store.registry import Registry

log = logging.getLogger("sluice.store")


class LeaseRecovery:
    """The recovery part of one replica's ``SlotLeases``: it reads the same leases and registry."""

    def __init__(self, registry: Registry, leases: dict[str, PoolLease], ttl_s: float,
                 recover_s: float | None) -> None:
        self.registry, self.leases = registry, leases
        # Redis back without the leases (see the module docstring): each lease capped at its
        # claim (what it held when the loss was found) until every replica has reported on
        # its pool, or recover_s (ttl/2) has passed.
        self.recover_s = ttl_s / 2 if recover_s is None else recover_s
        self.claims: dict[str, tuple[int, int]] = {}  # lease name -> (slots, kv) claim, while recovering
        self.recover_n = 0  # replicas to wait for: the most registered before the loss
        self.recover_until = -math.inf
        self.recoveries = 0  # times this replica found its leases lost (fenced)
        self._fences = 0  # the registry's fences already acted on (it counts from 0 too)

    def recover(self, now: float) -> None:
        """This replica's leases are no longer in Redis (its member was fenced: Redis restarted
        empty, or froze past the ttl): claim what it holds now, and re-assert it at once."""
        for ls in self.leases.values():
            ls.renew_at = -math.inf  # the next check re-asserts every lease under the new member
        if self.claims and now < self.recover_until:
            return  # already recovering: the claims taken at the first sign still bound the leases
        self.claims = {name: (ls.slots, ls.kv) for name, ls in self.leases.items()}
        self.recover_n = max(self.registry.steady, self.registry.most_seen(now) or 1)
        self.recover_until = now + self.recover_s
        self.recoveries += 1
        log.warning("slot leases: Redis lost this replica's leases; holding at most %s until the %d replicas "
                    "seen have reported (or %.1fs)", self.claims, self.recover_n, self.recover_s)

    def notice_fence(self, now: float) -> None:
        """The heartbeat registered this replica again (Redis lost its member): so are its leases."""
        if self.registry.fences != self._fences:
            self._fences = self.registry.fences
            self.recover(now)

    def cap(self, name: str, now: float, in_use: tuple[int, int] = (0, 0)) -> tuple[int, int] | None:
        """The most lease ``name`` may ask for while recovering (None: not recovering): its claim,
        or what its requests in flight hold (``in_use``: slots, kv) where that is more."""
        if not self.claims:
            return None
        if now >= self.recover_until:
            log.info("slot leases: not every replica reported within %.1fs of Redis losing the leases; "
                        "asking as usual", self.recover_s)
            self.claims = {}
            return None
        s, k = self.claims.get(name, (0, 0))
        return max(s, in_use[0]), max(k, in_use[1])

    def reported(self, name: str, ls: PoolLease) -> None:
        """An exchange while recovering: every registered replica (and as many as before the
        loss) has reported on this pool, so Redis knows all it must: the claim is lifted."""
        if name in self.claims and ls.reported >= max(ls.registered, self.recover_n):
            del self.claims[name]
            if not self.claims:
                log.info("slot leases: every replica reported again; asking as usual")
