"""Per-backend admission state: slot pool, watermark, breaker, and the wait queue.

The pure pieces live in ``extproc.policy``: ``BackendState`` is the ``BackendView``
that ``extproc.policy.admit.decide`` reads, and applies what it decides. This module
owns the acquisition, the ``status`` report, and keeps the pieces in step with the
policy; it holds its wait queue (``extproc.backends.queue``: a future per waiting
request, the pump, the deadlines, the periodic ``tick``) and its KV shares per tier, its
tenants' demand and its revocations (``extproc.backends.shares``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.backends import build
from extproc.backends.endpoints import EndpointSet
from extproc.backends.hold import Hold
from extproc.backends.pool_report import affinity_status, pool_status, pool_status_fields
from extproc.backends.queue import BackendQueue, Waiter
from extproc.backends.scrape import scrape_status
from extproc.backends.shared_kv_placement import Shares
from extproc.backends.shares import TierShares
from extproc.policy import admit
from extproc.policy import kv as kvmath
from extproc.policy.breaker import Breaker
from extproc.policy.concurrency import AdaptiveLimit
from extproc.policy.decision import ROOM_CAUSES, Admit, Queue, Reject
from extproc.policy.kv_shares import KvShare
from extproc.policy.reasons import Cause
from extproc.policy.schema import Backend, BreakerOverride, BreakerSettings, Policy
from extproc.policy.slots import Denied, PoolName, SlotPool
from extproc.policy.tenant_breakers import TenantBreakers
from extproc.policy.watermark import WatermarkController


@dataclass
class BackendState:
    spec: Backend
    pool: SlotPool
    wm: WatermarkController
    breaker: Breaker
    tenant_breakers: TenantBreakers  # failures blamed on one tenant trip that tenant's, not the backend's
    queue: BackendQueue = field(init=False)
    overrides: dict[str | None, BreakerOverride | None] = field(default_factory=dict)
    route_breakers: dict[str, Breaker] = field(default_factory=dict)
    route_settings: dict[str, BreakerSettings] = field(default_factory=dict)
    # A model with its own breaker judges its failures among that model's tenants.
    route_tenant_breakers: dict[str, TenantBreakers] = field(default_factory=dict)
    sample: object | None = None  # the last scrape.Sample, for status reports
    has_metrics: bool = True
    kv_in_use: int = 0
    priorities: dict[str, int] = field(default_factory=dict)
    adaptive_limit: AdaptiveLimit | None = None  # the SLO-driven concurrency limit, if a tier sets an SLO
    endpoints: EndpointSet | None = None  # a pool's replicas (extproc.backends.endpoints); None for one address
    kv_lease: int | None = None  # KV tokens leased from a pool shared by replicas (extproc.store.slot_leases)
    # Plain copies of the spec's values for the core's reads (BackendView), kept by _sync_view.
    name: str = field(init=False, default="")
    kv_capacity: int | None = field(init=False, default=None)
    kv_overcommit: float = field(init=False, default=1.0)
    kv_block_size: int = field(init=False, default=1)
    floor: float = field(init=False, default=0.0)
    has_slo: bool = field(init=False, default=False)  # a latency controller exists: slo_at_risk may say yes
    # Called when an acquire is denied for room (not a tenant cap): a shared store's
    # lease task is woken to grow the lease (extproc.runtime.leases.on_short).
    on_short: Callable[[BackendState, int, float], None] | None = None
    # Done when the lease check that on_short asked for has ended (a shared store; None: no
    # leases). Called at the refusal, not when awaited (SlotLeases.next_check).
    lease_wait: Callable[[], Awaitable[None]] | None = None
    # KV shares, tenants' demand, revocations
    shares: TierShares = field(default_factory=TierShares)

    @classmethod
    def create(cls, spec: Backend, policy: Policy, now: float) -> BackendState:
        order = policy.tier_order()
        rt = cls(spec=spec,
                 pool=SlotPool(spec.max_concurrency, {t: policy.tiers[t].guaranteed_slots for t in order}, order,
                               _burst_caps(policy)),
                 wm=build.watermark_controller(spec), breaker=build.breaker(spec.breaker, now),
                 tenant_breakers=build.tenant_breakers(spec.breaker, now), has_metrics=spec.metrics_url is not None)
        rt.queue = BackendQueue(rt, policy)
        rt.priorities = {name: t.priority for name, t in policy.tiers.items()}
        rt.shares.sync(policy)
        rt.endpoints = EndpointSet.create(spec, now) if spec.is_pool else None
        rt._sync_view(spec)
        rt._sync_latency(spec, policy, now)
        rt._sync_route_breakers(spec, now)
        rt.apply_override(policy, now)
        return rt

    def _sync_route_breakers(self, spec: Backend, now: float) -> None:
        """One breaker per model route that configures its own; kept across reloads."""
        wanted = {m.name: m.breaker for m in spec.models if m.breaker is not None}
        for name in [n for n in self.route_breakers if n not in wanted]:
            del self.route_breakers[name]
            del self.route_tenant_breakers[name]
        for name, settings in wanted.items():
            current = self.route_settings.get(name)
            if name not in self.route_breakers or current != settings:
                self.route_breakers[name] = build.breaker(settings, now)
                self.route_tenant_breakers[name] = build.tenant_breakers(settings, now)
                self.route_settings[name] = settings

    def tenants_for(self, model: str) -> TenantBreakers:
        """Where a request for ``model`` is attributed: its route's if it has a breaker, else the backend's."""
        return self.route_tenant_breakers.get(model, self.tenant_breakers)

    def _sync_latency(self, spec: Backend, policy: Policy, now: float) -> None:
        """The latency controller keeps its learned limit across reloads."""
        cfg = build.adaptive_config(spec, policy)
        if cfg is None:
            self.adaptive_limit = None
        elif self.adaptive_limit is None:
            self.adaptive_limit = AdaptiveLimit(cfg, now)
        elif cfg != self.adaptive_limit.cfg:
            self.adaptive_limit.reconfigure(cfg)
        self.has_slo = self.adaptive_limit is not None

    def _sync_view(self, spec: Backend) -> None:
        self.name, self.kv_capacity, self.kv_overcommit = spec.name, spec.kv_capacity_tokens, spec.kv_overcommit
        self.kv_block_size, self.floor = spec.kv_block_size, spec.watermark.floor

    def reconfigure(self, spec: Backend, policy: Policy, now: float) -> None:
        order = policy.tier_order()
        self.pool.reconfigure(spec.max_concurrency, {t: policy.tiers[t].guaranteed_slots for t in order}, order,
                              _burst_caps(policy))
        if spec.watermark != self.spec.watermark:
            self.wm = build.watermark_controller(spec)
        if spec.breaker != self.spec.breaker:
            self.breaker = build.breaker(spec.breaker, now)
            self.tenant_breakers = build.tenant_breakers(spec.breaker, now)
        self._sync_route_breakers(spec, now)
        self._sync_latency(spec, policy, now)
        self.queue.reconfigure(policy)
        self.spec = spec
        self._sync_view(spec)
        self.priorities = {name: t.priority for name, t in policy.tiers.items()}
        self.shares.sync(policy)
        self.has_metrics = spec.metrics_url is not None
        self._sync_endpoints(spec, now)
        self.apply_override(policy, now)

    def _sync_endpoints(self, spec: Backend, now: float) -> None:
        if self.endpoints is not None:
            # Leaving the pool drains: an endpoint with requests in flight stays until they finish.
            self.endpoints.sync(spec, now)
        elif spec.is_pool:
            self.endpoints = EndpointSet.create(spec, now)

    def apply_override(self, policy: Policy, now: float, wall: float | None = None) -> None:
        """Apply the policy's manual trips/resets for this backend and its routes, once per change."""
        mine = {o.model: o for o in policy.breakers if o.backend == self.spec.name and o.endpoint is None}
        wall = wall if wall is not None else time.time()
        if self.endpoints is not None:
            self.endpoints.apply_overrides({o.endpoint: o for o in policy.breakers
                                            if o.backend == self.spec.name and o.endpoint is not None}, now, wall)
        targets: dict[str | None, Breaker] = {None: self.breaker, **self.route_breakers}
        for model, breaker in targets.items():
            ov = mine.get(model)
            if ov == self.overrides.get(model):
                continue
            self.overrides[model] = ov
            if ov is None:
                breaker.set_manual(None, "", None, now)
            else:
                until = None if ov.until is None else now + (ov.until - wall)
                if until is not None and until <= now:  # expired (an old entry in the files)
                    breaker.set_manual(None, "", None, now)
                    continue
                breaker.set_manual(ov.state, ov.reason, until, now)

    @property
    def override(self) -> BreakerOverride | None:
        return self.overrides.get(None)

    # -- capacity -----------------------------------------------------------------------
    def scale(self, now: float) -> float:
        # A backend without a metrics endpoint has nothing to feed back; don't punish it.
        return self.wm.scale(now) if self.has_metrics else 1.0

    def slot_scale(self, now: float) -> float:
        """The slot budget's scale: the smaller of the watermark's and the latency limit's."""
        scale = self.scale(now)
        if self.adaptive_limit is not None:
            scale = min(scale, self.adaptive_limit.scale(now))
        return scale

    # -- the BackendView the core reads (extproc.policy.view), beside the fields above ------
    @property
    def largest_kv_capacity(self) -> int | None:
        # A footprint must fit one endpoint's cache.
        return self.spec.kv_capacity_tokens if self.endpoints is None else self.endpoints.largest_capacity()

    def slo_at_risk(self, tier: str, now: float) -> bool:
        return self.adaptive_limit is not None and self.adaptive_limit.at_risk(tier, now)

    def slot_for(self, tier: str, tenant: str, tenant_cap: int | None, scale: float) -> PoolName | Denied:
        return self.pool.slot_for(tier, tenant, tenant_cap, scale)

    def fits_somewhere(self, kv: int, now: float, tier: str | None = None) -> bool:
        if self.endpoints is None:
            return True
        return self.endpoints.fits_somewhere(
            kv, now, self.queue.owed_endpoints(tier, now), self.shares_for(tier, now)
        )

    @property
    def kv_shares(self) -> Mapping[str, KvShare]:
        return self.shares.shares

    @property
    def kv_by_tier(self) -> Mapping[str, int]:
        return self.shares.kv_by_tier

    def kv_active(self, now: float) -> dict[str, bool]:
        return self.shares.kv_active(self.priorities, self.queue.queued, now)

    def leads(self, tier: str, tenant: str, work: float) -> bool:
        return self.queue.order.leads(tier, tenant, work)

    def peer_headroom(self, tier: str, tenant: str, now: float) -> int:
        return self.shares.peer_headroom(self.queue, tier, tenant, kvmath.kv_budget(self, now), now)

    def under_share(self, tier: str, tenant: str, now: float) -> bool:
        return self.shares.under_share(tier, tenant, kvmath.kv_budget(self, now), now)

    def shares_for(self, tier: str | None, now: float) -> Shares | None:
        """What a pool endpoint's placement needs to keep the tiers' guarantees there."""
        if tier is None or not self.shares.shares:
            return None
        return tier, self.shares.shares, self.kv_active(now)

    # -- the queue's callbacks (extproc.backends.queue.Backend) -------------------------------
    def waiting_changed(self, tier: str, tenant: str, kv: int, now: float) -> None:
        self.shares.waiting_changed(tier, tenant, kv, now)
        if kv > 0 and self.shares.shares:
            self.reclaim(now)

    def reclaim(self, now: float) -> int:
        """Revocations for the waiters of tiers with a KV guarantee (extproc.backends.shares)."""
        return self.shares.reclaim(self, now) if self.shares.shares else 0

    @property
    def waiters(self) -> Mapping[int, Waiter]:
        return self.queue.waiters

    def waiting(self) -> Sequence[tuple[str, int]]:
        return self.queue.waiting()

    def queued(self, tier: str) -> int:
        return self.queue.queued(tier)

    # -- acquisition ----------------------------------------------------------------
    def acquire(self, req: admit.SlotRequest, now: float, prefix: tuple[int, ...] = ()) -> Hold | Queue | Reject:
        """What ``extproc.policy.admit.decide`` says, applied: a ``Hold``, or wait, or refuse.

        ``prefix`` (the prompt's prefix keys) only steers where a pool places it."""
        self.shares.asked(req.tier, now)
        # Waiting requests get free capacity first (see decide for who may overtake them).
        if self.queue.waiters:  # every queued item has a waiter
            self.queue.pump(now)
        d = admit.decide(self, req, now)
        if isinstance(d, Admit):
            got = self._apply(req.tier, req.tenant, d, req.kv, now, prefix)
            if isinstance(got, Hold):
                self.queue.order.charge(req.tier, req.tenant, req.work, now)
                return got
            d = admit.refused(req, got)
        if self.on_short is not None and d.cause in ROOM_CAUSES:
            self.on_short(self, req.kv, now)
        return d

    def take(self, tier: str, tenant: str, cap: int | None, kv: int, now: float,
              prefix: tuple[int, ...] = (), behind_head: bool = False) -> Hold | Denied:
        got = admit.take(self, tier, tenant, cap, kv, now)
        return self._apply(tier, tenant, got, kv, now, prefix, behind_head) if isinstance(got, Admit) else got

    def _apply(self, tier: str, tenant: str, d: Admit, kv: int, now: float,
               prefix: tuple[int, ...] = (), behind_head: bool = False) -> Hold | Denied:
        grant = self.pool.grant(tier, tenant, d.pool)
        endpoint = affinity = second = None
        if self.endpoints is not None:
            placed = self.endpoints.place(
                kv,
                now,
                prefix,
                self.queue.owed_endpoints(tier, now, behind_head),
                self.shares_for(tier, now),
                tier,
            )
            if placed is None:
                self.pool.release(grant)
                return Denied(Cause.KV_EXHAUSTED, f"a footprint of {kv} tokens fits on no endpoint of the pool now")
            endpoint, affinity, second = placed.key, placed.affinity, placed.second
        self.kv_in_use += kv
        self.shares.held(tier, tenant, kv, now)
        return Hold(grant, kv, endpoint, affinity, second)

    def give_back(self, hold: Hold) -> None:
        self.shares.revocations.untrack(hold.grant.id, time.time())
        self.pool.release(hold.grant)
        self.kv_in_use -= hold.kv
        self.shares.freed(hold.grant.tier, hold.grant.tenant, hold.kv)
        if hold.endpoint is not None and self.endpoints is not None:
            self.endpoints.release(hold.endpoint, hold.kv, hold.grant.tier)

    def release(self, hold: Hold, now: float) -> None:
        self.give_back(hold)
        # its tier's demand is held from its last request's end
        self.shares.ended(hold.grant.tier, now)
        self.queue.pump(now)

    def status(self, now: float) -> dict[str, Any]:
        """This backend in the status report (/debug/state and the console's Overview)."""
        sample = self.sample
        use = self.pool.in_use()
        limits = self.pool.effective_limits(self.slot_scale(now))
        routes = {model: {**_breaker_summary(b.snapshot(now)), "tenant_breakers": self.tenants_for(model).snapshot(now)}
                  for model, b in self.route_breakers.items()}
        # A pool has no scrape of its own: its line is its endpoints' sums (backends.pool_report).
        own = pool_status_fields(self.endpoints, now) if self.endpoints is not None else {
            **scrape_status(sample, self.kv_in_use, self.spec.kv_capacity_tokens, self.has_metrics),
            "waiting": getattr(sample, "waiting", None),
            "running": getattr(sample, "running", None),
            "scrape_ok": bool(getattr(sample, "ok", False))}
        return {
            **own,
            "scale": round(self.scale(now), 4),
            "breaker": _breaker_summary(self.breaker.snapshot(now)),
            "route_breakers": routes,
            "tenant_breakers": self.tenant_breakers.snapshot(now),
            "slots": {"total": self.pool.total, "effective": limits["total"], "in_use": use.total,
                      "shared": use.shared, "by_tier": dict(use.by_tier)},
            "queue": {"depth": {t: self.queue.depth(t) for t in self.queue.configs}},
            "kv": {"capacity_tokens": self.spec.kv_capacity_tokens, "reserved_tokens": self.kv_in_use,
                   "budget_tokens": None if self.spec.kv_capacity_tokens is None else int(kvmath.kv_budget(self, now)),
                   "reservation": self.spec.kv_reservation},
            "adaptive": None if self.adaptive_limit is None else self.adaptive_limit.snapshot(now),
            "kv_shares": self.shares.status(self, now),
            "fair_share": self.shares.fair_status(self.queue, now),
            "endpoints": pool_status(self.endpoints, now),  # a pool's replicas; None for one address
            "prefix_affinity": affinity_status(self.endpoints),  # None unless the pool's placement has it on
        }


def _breaker_summary(snap: Mapping[str, Any]) -> dict[str, Any]:
    return {"state": snap.get("state"), "retry_after_s": snap.get("cooldown_left_s"),
            "manual": snap.get("manual"), "trips": snap.get("trips", 0)}


def _burst_caps(policy: Policy) -> dict[str, int]:
    return {name: t.burst_slots for name, t in policy.tiers.items() if t.burst_slots is not None}
