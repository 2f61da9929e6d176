"""One replica's share of a tenant's shared TPM/RPM bucket: the local lease.

The bucket itself lives in a shared store (``extproc.store``) and is the truth. A
replica takes a slice of it ahead of use (the lease) and spends the slice locally;
the store computes the slice as ``min(C, (level - headroom) / (2 x live replicas))``,
so it shrinks to nothing as the bucket nears empty. A lease is taken out of the
bucket when granted, which keeps ``level + every live lease <= capacity``: leases add
no overshoot, whatever the number of replicas.

Everything here is counted cumulatively (granted, spent, credited, debited), so an
exchange with the store whose reply was lost can be sent again unchanged.

Pure: callers pass ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from extproc.policy.bucket import TokenBucket
from extproc.policy.gate import RateView
from extproc.policy.model import Limits

__all__ = ["TenantLease", "local_share"]


@dataclass(slots=True)
class TenantLease:
    limits: Limits  # the tenant's limits and watermark scale as last seen
    scale: float = 1.0
    lease_limits: Limits | None = None  # what the lease was granted under
    lease_scale: float = 1.0
    # cumulative counters, shared with the store (see extproc/store/scripts.py)
    granted_t: float = 0.0
    granted_r: float = 0.0
    spent_t: float = 0.0
    spent_r: float = 0.0
    credit: float = 0.0  # refunds owed to the bucket
    debit: float = 0.0  # excess usage and charges the store has not seen
    debit_r: float = 0.0  # requests admitted without the store
    sent: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (credit, debit, debit_r) the store confirmed
    down: float = 0.0  # the part of ``debit`` admitted on the local share (the store unreachable)
    down_sent: float = 0.0  # ``down`` the store confirmed
    expires: float = -math.inf  # the lease may be spent before this (local clock)
    last_slice: float = 0.0
    spent_at_grant: float = 0.0  # spent_t when the lease was granted: unchanged means idle
    # the store's last answer: levels outside every lease, when they were seen
    level_t: float | None = None
    level_r: float | None = None
    seen_at: float = 0.0
    # while the store is unreachable: this replica's share of the bucket
    fallback: tuple[TokenBucket, TokenBucket] | None = None
    forgotten: bool = False
    waiters: list = field(default_factory=list)
    inflight: object | None = None

    @property
    def lease_t(self) -> float:
        return max(0.0, self.granted_t - self.spent_t)

    @property
    def lease_r(self) -> float:
        return max(0.0, self.granted_r - self.spent_r)

    def headroom(self, limits: Limits, scale: float) -> float:
        return (1.0 - scale) * limits.burst_tokens

    def try_spend(self, limits: Limits, cost: int, scale: float, now: float) -> bool:
        """Admit from the lease, if it was granted under these limits and covers the request."""
        if (now < self.expires and limits == self.lease_limits and scale >= self.lease_scale
                and self.lease_t >= cost and self.lease_r >= 1):
            self.spent_t += cost
            self.spent_r += 1
            return True
        return False

    def low(self) -> bool:
        """The lease is running out: refill it ahead of need."""
        return self.last_slice > 0 and self.lease_t < self.last_slice / 2

    def unsent_t(self) -> float:
        """Tokens this replica charged (debits less refunds) that the store has not confirmed."""
        return (self.debit - self.sent[1]) - (self.credit - self.sent[0])

    def dirty(self) -> bool:
        return (self.credit, self.debit, self.debit_r) != self.sent

    def estimate_t(self, now: float) -> float:
        """The bucket's level outside every lease, extrapolated from the store's last answer."""
        if self.level_t is None:
            return float(self.limits.burst_tokens)
        rate = self.limits.tpm * self.scale / 60.0
        cap = self.limits.burst_tokens
        lvl = self.level_t
        return lvl if lvl >= cap else min(cap, lvl + rate * max(0.0, now - self.seen_at))

    def estimate_raw_t(self, now: float) -> float:
        """``estimate_t`` before the cap: what the refill since the last answer would add."""
        if self.level_t is None:
            return float(self.limits.burst_tokens)
        return self.level_t + self.limits.tpm * self.scale / 60.0 * max(0.0, now - self.seen_at)

    def estimate_r(self, now: float) -> float:
        if self.level_r is None:
            return float(self.limits.rpm)
        cap = self.limits.rpm
        lvl = self.level_r
        return lvl if lvl >= cap else min(cap, lvl + cap / 60.0 * max(0.0, now - self.seen_at))

    def view(self, now: float) -> tuple[RateView, RateView]:
        lim = self.limits
        if self.fallback is not None:
            tb, rb = self.fallback
            t, r = tb.remaining(now) + self.lease_t, rb.remaining(now) + self.lease_r
        else:
            t, r = self.estimate_t(now) + self.lease_t, self.estimate_r(now) + self.lease_r
        rate_t = max(lim.tpm * self.scale / 60.0, 1e-9)
        rate_r = max(lim.rpm / 60.0, 1e-9)
        return (RateView(lim.tpm, max(0, math.floor(t)), max(0.0, lim.burst_tokens - t) / rate_t),
                RateView(lim.rpm, max(0, math.floor(r)), max(0.0, lim.rpm - r) / rate_r))


def local_share(lease: TenantLease, limits: Limits, replicas: int, now: float) -> tuple[TokenBucket, TokenBucket]:
    """This replica's buckets while the store is unreachable: 1/replicas of the contract.

    They refill at 1/replicas of the rate and start at 1/replicas of the room the store
    last reported (refilled since, less what this replica charged that the store has not
    heard; the whole bucket for a tenant it never answered for, as the store itself starts
    a bucket it does not have from the caller's estimate), less what the others may have
    been granted out of it since. The room each replica saw is as old as its last answer,
    and since then each other replica may have been granted a lease, of at most
    room / (2 x replicas) (the store's slice): (n + 1) / 2n of the room is there whatever
    one grant each took. Started at all of it, the shares admitted ~4 % over the contract
    in a 0.5 s window (tests/test_state_redis_outage.py, once in a loaded run). Shares
    that started empty refused the first request after every trip for the few ms their
    refill took: a 429 for a tenant far under its limit whenever one answer came late on a
    loaded host (a false alarm, the others still on Redis; or a replica's first exchange,
    before any answer set its bound). What a false alarm adds is bounded by that part of
    the room, once: its debits reach Redis on the return, which carries them as the
    bucket's debt.
    """
    n = max(1, replicas)
    part = (n + 1) / (2 * n * n)  # of the room: what one grant to each other left, split n ways
    room_t = max(0.0, lease.estimate_t(now) - lease.unsent_t())
    room_r = max(0.0, lease.estimate_r(now) - (lease.debit_r - lease.sent[2]))
    tb = TokenBucket(limits.burst_tokens / n, limits.tpm * lease.scale / 60.0 / n, now, level=room_t * part)
    rb = TokenBucket(limits.rpm / n, limits.rpm / 60.0 / n, now, level=room_r * part)
    return tb, rb
