"""What the admission core reads about one backend (or pool): ``BackendView``.

A read-only protocol of plain-value accessors. The live ``extproc.backends.state.BackendState``
implements it (nothing is copied on the hot path); ``BackendSnapshot`` is a frozen
implementation for tests and reports. Accessors that take ``now`` are pure in it:
the same state and the same ``now`` give the same answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.policy.kv_shares import KvShare
from extproc.policy.reasons import Cause
from extproc.policy.slots import (
    Denied,
    PoolName,
    round_half_up,
)

__all__ = ["BackendSnapshot", "BackendView"]


class BackendView(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def kv_in_use(self) -> int:
        """KV tokens reserved by the requests admitted and not yet settled."""
        ...

    @property
    def kv_capacity(self) -> int | None:
        """The cache in tokens (None: not bounded by Sluice)."""
        ...

    @property
    def largest_kv_capacity(self) -> int | None:
        """The largest single cache a footprint must fit (a pool's biggest endpoint)."""
        ...

    @property
    def kv_overcommit(self) -> float: ...

    @property
    def kv_lease(self) -> int | None:
        """KV tokens leased to this replica from a shared pool (None: not shared)."""
        ...

    @property
    def kv_block_size(self) -> int: ...

    @property
    def floor(self) -> float:
        """The watermark's floor: the scale a degraded tier sees under pressure."""
        ...

    @property
    def priorities(self) -> Mapping[str, int]: ...

    @property
    def has_slo(self) -> bool:
        """Whether any tier has a latency SLO (``slo_at_risk`` can say yes)."""
        ...

    @property
    def waiters(self) -> Collection[object]:
        """Empty when nothing waits: a cheap test before ``waiting`` and ``queued``."""
        ...

    @property
    def kv_shares(self) -> Mapping[str, KvShare]:
        """Each tier's KV guarantee and burst cap (extproc.policy.kv_shares); empty: none set."""
        ...

    @property
    def kv_by_tier(self) -> Mapping[str, int]:
        """KV tokens reserved per tier (only read when ``kv_shares`` is set)."""
        ...

    def kv_active(self, now: float) -> Mapping[str, bool]:
        """Which tiers have demand (extproc.policy.kv_shares.tier_active) and keep their
        guarantee."""
        ...

    def leads(self, tier: str, tenant: str, work: float) -> bool:
        """Whether a newcomer of ``tenant`` goes before every waiting request of ``tier``
        (fair share by work, extproc.policy.fair_share)."""
        ...

    def peer_headroom(self, tier: str, tenant: str, now: float) -> int:
        """The KV a request of ``tenant`` leaves free for its tier's less-served tenants."""
        ...

    def scale(self, now: float) -> float:
        """The watermark scale (1.0 for a backend without metrics)."""
        ...

    def slot_scale(self, now: float) -> float:
        """The slot budget's scale: the smaller of the watermark's and the latency limit's."""
        ...

    def waiting(self) -> Sequence[tuple[str, int]]:
        """``(tier, kv footprint)`` of every request still waiting in the queue."""
        ...

    def queued(self, tier: str) -> int:
        """How many requests of ``tier`` wait in the queue."""
        ...

    def slo_at_risk(self, tier: str, now: float) -> bool: ...

    def slot_for(self, tier: str, tenant: str, tenant_cap: int | None, scale: float) -> PoolName | Denied:
        """The pool a slot would come from at ``scale``, or why there is none."""
        ...

    def fits_somewhere(self, kv: int, now: float, tier: str | None = None) -> bool:
        """Whether a pool endpoint has room for ``kv`` now (True for a single address); with
        ``tier``, leaving out the endpoint owed to a blocked waiter above it (extproc.policy.owed)."""
        ...


@dataclass(frozen=True)
class BackendSnapshot:
    """A frozen ``BackendView``: plain values, with a simple slot model.

    Slots: ``slots_total`` scaled (half up) is the budget for all tiers, ``slots_in_use``
    are held, ``tenant_held`` counts per tenant. Endpoints: ``endpoint_room`` is the
    largest footprint some endpoint takes now (None: a single address). KV shares: a tier
    is active if it reserves, waits, or is named in ``active``.
    """

    name: str = "b"
    kv_in_use: int = 0
    kv_capacity: int | None = None
    kv_overcommit: float = 1.0
    kv_lease: int | None = None
    kv_block_size: int = 16
    largest_capacity: int | None = None  # defaults to kv_capacity
    floor: float = 0.6
    watermark_scale: float = 1.0
    latency_scale: float = 1.0
    priorities: Mapping[str, int] = field(default_factory=dict)
    waiters: tuple[tuple[str, int], ...] = ()
    at_risk: frozenset[str] = frozenset()
    slots_total: int = 8
    slots_in_use: int = 0
    tenant_held: Mapping[str, int] = field(default_factory=dict)
    endpoint_room: int | None = None
    kv_shares: Mapping[str, KvShare] = field(default_factory=dict)
    kv_by_tier: Mapping[str, int] = field(default_factory=dict)
    active: frozenset[str] = frozenset()
    leaders: frozenset[str] = frozenset()  # tenants whose newcomers go before their tier's waiters
    headroom: Mapping[str, int] = field(
        default_factory=dict
    )  # tenant -> KV it leaves for less-served peers

    def kv_active(self, now: float) -> Mapping[str, bool]:
        return {
            t: t in self.active or self.kv_by_tier.get(t, 0) > 0 or self.queued(t) > 0
            for t in self.kv_shares
        }

    def leads(self, tier: str, tenant: str, work: float) -> bool:
        return tenant in self.leaders

    def peer_headroom(self, tier: str, tenant: str, now: float) -> int:
        return self.headroom.get(tenant, 0)

    @property
    def largest_kv_capacity(self) -> int | None:
        return self.kv_capacity if self.largest_capacity is None else self.largest_capacity

    @property
    def has_slo(self) -> bool:
        return bool(self.at_risk)

    def scale(self, now: float) -> float:
        return self.watermark_scale

    def slot_scale(self, now: float) -> float:
        return min(self.watermark_scale, self.latency_scale)

    def waiting(self) -> Sequence[tuple[str, int]]:
        return self.waiters

    def queued(self, tier: str) -> int:
        return sum(1 for t, _ in self.waiters if t == tier)

    def slo_at_risk(self, tier: str, now: float) -> bool:
        return tier in self.at_risk

    def slot_for(self, tier: str, tenant: str, tenant_cap: int | None, scale: float) -> PoolName | Denied:
        if tenant_cap is not None and self.tenant_held.get(tenant, 0) >= tenant_cap:
            return Denied(Cause.SLOTS_TENANT_CAP, f"tenant {tenant!r} holds {self.tenant_held.get(tenant, 0)} of "
                          f"{tenant_cap} slots")
        budget = round_half_up(self.slots_total * scale)
        if self.slots_in_use >= budget:
            return Denied(Cause.SLOTS_EXHAUSTED, f"{self.slots_in_use} slots in use, budget {budget}")
        return "shared"

    def fits_somewhere(self, kv: int, now: float, tier: str | None = None) -> bool:
        return self.endpoint_room is None or kv <= self.endpoint_room
