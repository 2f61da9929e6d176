"""One backend's KV shares per tier, its tenants' demand, and the revocations it makes.

``BackendState`` holds one (``shares``) and reads its accessors as the ``BackendView`` the
core reads (``kv_shares``, ``kv_by_tier``, ``kv_active``, ``peer_headroom``): what each
tier reserves and whether it has demand (``extproc.policy.kv_shares``), what each tenant
of a tier holds, waits for and recently needed (peer headroom and the fair-share
look-ahead, ``extproc.policy.fair_share``), and, when a waiter of a tier with a guarantee
lacks room, the revocations (``reclaim``: ``extproc.policy.revoke`` decides,
``extproc.backends.revocation`` keeps them).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from extproc.backends.revocation import Revocations
from extproc.policy import kv as kvmath
from extproc.policy.fair_share import Demand, under_share
from extproc.policy.kv_shares import DEMAND_HOLD_S, KvShare, tier_active
from extproc.policy.owed import designate
from extproc.policy.revoke import Need, shortfall, should_revoke, slo_at_risk
from extproc.policy.schema import Policy

if TYPE_CHECKING:
    from extproc.backends.queue import BackendQueue, Waiter


class SharedBackend(Protocol):
    """What of ``extproc.backends.state.BackendState`` the shares read: named here, not
    imported, because the backend holds its shares (imports run one way)."""

    priorities: Mapping[str, int]
    queue: BackendQueue
    endpoints: Any

    def slo_at_risk(self, tier: str, now: float) -> bool: ...
    def kv_active(self, now: float) -> Mapping[str, bool]: ...
    def shares_for(self, tier: str | None, now: float) -> Any: ...

__all__ = ["TierShares"]

# Tenants remembered per tier for their demand; idle ones beyond this are forgotten.
MAX_TENANTS = 256


@dataclass
class TierShares:
    shares: dict[str, KvShare] = field(default_factory=dict)  # tiers with a share (empty: none set)
    revocable: dict[str, bool] = field(
        default_factory=dict
    )  # tiers whose answered requests may be ended
    ttft_slos: dict[str, int] = field(
        default_factory=dict
    )  # each tier's ttft_p99_ms, where it sets one
    kv_by_tier: Counter[str] = field(default_factory=Counter)
    last_seen: dict[str, float] = field(
        default_factory=dict
    )  # a request of the tier last asked or ended
    demand: dict[str, dict[str, Demand]] = field(
        default_factory=dict
    )  # tier -> tenant -> its KV demand
    revocations: Revocations = field(default_factory=Revocations)

    def sync(self, policy: Policy) -> None:
        self.shares = {
            name: KvShare(t.kv_guaranteed, t.kv_burst)
            for name, t in policy.tiers.items()
            if t.kv_guaranteed > 0 or t.kv_burst is not None
        }
        self.revocable = {name: t.revocable for name, t in policy.tiers.items()}
        self.ttft_slos = {name: t.ttft_p99_ms for name, t in policy.tiers.items() if t.ttft_p99_ms}

    # -- what is held and asked for --------------------------------------------------------
    def asked(self, tier: str, now: float) -> None:
        self.last_seen[tier] = now

    def held(self, tier: str, tenant: str, kv: int, now: float) -> None:
        self.kv_by_tier[tier] += kv
        d = self._tenant(tier, tenant, now)
        d.held += kv
        d.note(now)

    def freed(self, tier: str, tenant: str, kv: int) -> None:
        self.kv_by_tier[tier] -= kv
        if self.kv_by_tier[tier] <= 0:
            del self.kv_by_tier[tier]
        d = self.demand.get(tier, {}).get(tenant)
        if d is not None:
            d.held = max(0, d.held - kv)

    def ended(self, tier: str, now: float) -> None:
        """A request of ``tier`` ended: its demand is held from here (``DEMAND_HOLD_S``)."""
        self.last_seen[tier] = now

    def waiting_changed(self, tier: str, tenant: str, kv: int, now: float) -> None:
        d = self._tenant(tier, tenant, now)
        d.waiting = max(0, d.waiting + kv)
        if kv > 0:
            d.note(now)

    def _tenant(self, tier: str, tenant: str, now: float) -> Demand:
        per = self.demand.setdefault(tier, {})
        d = per.get(tenant)
        if d is None:
            if len(per) >= MAX_TENANTS:
                for t in [
                    t
                    for t, x in per.items()
                    if not x.held and not x.waiting and now - x.at >= DEMAND_HOLD_S
                ]:
                    del per[t]
            d = per[tenant] = Demand(at=now)
        return d

    # -- what the core reads ----------------------------------------------------------------
    def kv_active(
        self, tiers: Mapping[str, int], queued: Callable[[str], int], now: float
    ) -> dict[str, bool]:
        """Which tiers have demand: every tier, as revocation needs the victims' too."""
        return {
            t: tier_active(self.kv_by_tier.get(t, 0), queued(t), self.last_seen.get(t), now)
            for t in tiers
        }

    def peer_headroom(
        self, queue: BackendQueue, tier: str, tenant: str, budget: float, now: float
    ) -> int:
        demand = self.demand.get(tier)
        if not demand or len(demand) < 2:
            return 0
        return queue.order.headroom(tier, tenant, demand, budget, now, DEMAND_HOLD_S)

    def under_share(self, tier: str, tenant: str, budget: float, now: float) -> bool:
        demand = self.demand.get(tier)
        return not demand or under_share(demand, tenant, budget, now, DEMAND_HOLD_S)

    # -- revocation ---------------------------------------------------------------------------
    def reclaim(self, be: SharedBackend, now: float, wall: float | None = None) -> int:
        """Take KV room back from lower tiers for the head of each tier with a KV guarantee that
        waits for room, where ``should_revoke`` allows it. Returns the KV tokens now freeing."""
        freeing = 0
        for tier in sorted(self.shares, key=lambda t: -be.priorities.get(t, 0)):
            if self.shares[tier].guaranteed <= 0 or (head := be.queue.head(tier)) is None:
                continue
            got = self._need(be, tier, head, now)
            if got is None:
                continue
            need, budget = got
            risk = slo_at_risk(
                be.slo_at_risk(tier, now), now - head.queued_at, self.ttft_slos.get(tier)
            )
            if not should_revoke(self.shares, self.kv_by_tier, tier, head.kv, budget, risk):
                continue
            freeing += self.revocations.reclaim(
                need,
                now,
                time.time() if wall is None else wall,
                be.priorities,
                self.revocable,
                self.shares,
                self.kv_by_tier,
                be.kv_active(now),
                budget,
                lambda t: (
                    max(1.0, be.queue.retry_after_hint(t, now)) if t in be.queue.configs else 1.0
                ),
            )
        return freeing

    def _need(
        self, be: SharedBackend, tier: str, head: Waiter, now: float
    ) -> tuple[Need, float] | None:
        """The room ``head`` lacks (on the pool endpoint it would fit soonest), and the budget it
        is judged on; None when KV is not what it waits for."""
        if be.endpoints is None:
            if kvmath.kv_fits(be, head.kv, now, tier, head.tenant):
                return None
            return Need(tier, shortfall(be, tier, head.kv, now)), kvmath.kv_budget(be, now)
        cands = be.endpoints.candidates(now, head.kv, be.shares_for(tier, now))
        key = designate(cands, head.kv)
        c = next((c for c in cands if c.key == key), None)
        if c is None or c.kv_capacity is None:
            return None
        budget = c.kv_capacity * c.kv_scale
        missing = c.kv_in_use + head.kv + c.kv_reserved - budget
        return (Need(tier, int(missing) + 1, key), budget) if missing > 0 else None

    # -- the status report ------------------------------------------------------------------
    def status(self, be: SharedBackend, now: float) -> dict[str, Any] | None:
        """Each tier's KV guarantee, burst cap, reservations and demand, and the revocations."""
        if not self.shares:
            return None
        budget = kvmath.kv_budget(be, now)
        finite = budget != float("inf")
        active = be.kv_active(now)
        none = KvShare()
        tiers = {}
        for t in be.priorities:
            s = self.shares.get(t, none)
            tiers[t] = {
                "guaranteed_tokens": int(s.guaranteed * budget) if finite else None,
                "burst_tokens": None if s.burst is None or not finite else int(s.burst * budget),
                "reserved_tokens": self.kv_by_tier.get(t, 0),
                "active": active.get(t, False),
                "revocable": self.revocable.get(t, False),
            }
        return {"tiers": tiers, "revocation": self.revocations.status()}

    def fair_status(self, queue: BackendQueue, now: float) -> dict[str, Any]:
        """Per tier: tenants with requests waiting, their service difference, Jain's index."""
        out = {}
        for t in queue.configs:
            diff, jain = queue.order.fairness(t, now)
            out[t] = {
                "backlogged": queue.order.backlogged(t),
                "service_difference": round(diff, 1),
                "jain": round(jain, 4),
            }
        return out
