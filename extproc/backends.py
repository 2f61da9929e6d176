"""Per-backend admission state: slot pool, watermark, breaker, and the wait queue.

The pure pieces live in ``extproc.policy``; this module owns the asyncio side of the
queue (a future per waiting request) and keeps the pieces in step with the policy.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.endpoints import EndpointSet
from extproc.latency import adaptive_config
from extproc.policy.admission_queue import AdmissionQueue, Enqueued, TierQueueConfig
from extproc.policy.breaker import Breaker, BreakerConfig
from extproc.policy.concurrency import AdaptiveLimit
from extproc.policy.schema import Backend, BreakerOverride, BreakerSettings, Policy
from extproc.policy.slots import REASON_TENANT_CAP, Denied, SlotGrant, SlotPool
from extproc.policy.tenant_breakers import TenantBreakers
from extproc.policy.watermark import WatermarkController

_PROBE_TENANT = "\x00probe"
_ids = itertools.count(1)


def breaker_config(s: BreakerSettings) -> BreakerConfig:
    return BreakerConfig(window_s=s.window_s, min_requests=s.min_requests, error_ratio=s.error_ratio,
                         consecutive_failures=s.consecutive_failures, latency_slo_s=s.latency_slo_s,
                         cooldown_s=s.cooldown_s, max_cooldown_s=max(s.max_cooldown_s, s.cooldown_s),
                         ramp_steps=tuple(s.ramp_steps), ramp_step_s=s.ramp_step_s,
                         trip_on_preemption=s.trip_on_preemption, preemption_threshold=s.preemption_threshold)


def tenant_breakers(s: BreakerSettings, now: float) -> TenantBreakers:
    return TenantBreakers(breaker_config(s), s.min_failing_tenants, s.max_tenant_breakers, now)


def watermark_controller(b: Backend) -> WatermarkController:
    w = b.watermark
    return WatermarkController(high=w.high, low=w.low, floor=w.floor, alpha=w.smoothing,
                               recover_per_s=w.recover_per_s, stale_after_s=w.stale_after_s,
                               waiting_threshold=w.waiting_threshold)


@dataclass
class Waiter:
    id: int
    tier: str
    tenant: str
    tenant_cap: int | None
    kv: int
    future: asyncio.Future[Hold | Denied]


@dataclass(frozen=True)
class Hold:
    """What an admitted request holds on a backend: a slot and its KV footprint."""

    grant: SlotGrant
    kv: int
    endpoint: str | None = None  # the pool endpoint it was placed on (host:port)


@dataclass
class BackendRuntime:
    spec: Backend
    pool: SlotPool
    wm: WatermarkController
    breaker: Breaker
    tenant_breakers: TenantBreakers  # failures blamed on one tenant trip that tenant's, not the backend's
    queue: AdmissionQueue[int]
    waiters: dict[int, Waiter] = field(default_factory=dict)
    configs: dict[str, TierQueueConfig] = field(default_factory=dict)
    overrides: dict[str | None, BreakerOverride | None] = field(default_factory=dict)
    route_breakers: dict[str, Breaker] = field(default_factory=dict)
    route_settings: dict[str, BreakerSettings] = field(default_factory=dict)
    # A model with its own breaker judges its failures among that model's tenants.
    route_tenant_breakers: dict[str, TenantBreakers] = field(default_factory=dict)
    sample: object | None = None  # the last scrape.Sample, for status reports
    has_metrics: bool = True
    kv_in_use: int = 0
    priorities: dict[str, int] = field(default_factory=dict)
    latency: AdaptiveLimit | None = None  # the SLO-driven concurrency limit, if a tier sets an SLO
    endpoints: EndpointSet | None = None  # a pool's replicas (extproc.endpoints); None for one address
    kv_lease: int | None = None  # KV tokens leased from a pool shared by replicas (extproc.store.slot_leases)
    # Called when an acquire is denied for room (not a tenant cap): a shared store's
    # lease task is woken to grow the lease (extproc.store.lease_plan.on_short).
    on_short: Callable[[BackendRuntime, int, float], None] | None = None

    @classmethod
    def create(cls, spec: Backend, policy: Policy, now: float) -> BackendRuntime:
        order = policy.tier_order()
        configs = _queue_configs(policy)
        rt = cls(spec=spec,
                 pool=SlotPool(spec.max_concurrency, {t: policy.tiers[t].guaranteed_slots for t in order}, order,
                               _burst_caps(policy)),
                 wm=watermark_controller(spec), breaker=Breaker(breaker_config(spec.breaker), now),
                 tenant_breakers=tenant_breakers(spec.breaker, now),
                 queue=AdmissionQueue(configs), configs=configs, has_metrics=spec.metrics_url is not None)
        rt.priorities = {name: t.priority for name, t in policy.tiers.items()}
        rt.endpoints = EndpointSet.create(spec, now) if spec.is_pool else None
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
                self.route_breakers[name] = Breaker(breaker_config(settings), now)
                self.route_tenant_breakers[name] = tenant_breakers(settings, now)
                self.route_settings[name] = settings

    def tenants_for(self, model: str) -> TenantBreakers:
        """Where a request for ``model`` is attributed: its route's if it has a breaker, else the backend's."""
        return self.route_tenant_breakers.get(model, self.tenant_breakers)

    def _sync_latency(self, spec: Backend, policy: Policy, now: float) -> None:
        """The latency controller keeps its learned limit across reloads."""
        cfg = adaptive_config(spec, policy)
        if cfg is None:
            self.latency = None
        elif self.latency is None:
            self.latency = AdaptiveLimit(cfg, now)
        elif cfg != self.latency.cfg:
            self.latency.reconfigure(cfg)

    def reconfigure(self, spec: Backend, policy: Policy, now: float) -> None:
        order = policy.tier_order()
        self.pool.reconfigure(spec.max_concurrency, {t: policy.tiers[t].guaranteed_slots for t in order}, order,
                              _burst_caps(policy))
        if spec.watermark != self.spec.watermark:
            self.wm = watermark_controller(spec)
        if spec.breaker != self.spec.breaker:
            self.breaker = Breaker(breaker_config(spec.breaker), now)
            self.tenant_breakers = tenant_breakers(spec.breaker, now)
        self._sync_route_breakers(spec, now)
        self._sync_latency(spec, policy, now)
        if _queue_configs(policy) != self.configs:
            self._requeue(policy, now)
        self.spec = spec
        self.priorities = {name: t.priority for name, t in policy.tiers.items()}
        self.has_metrics = spec.metrics_url is not None
        self._sync_endpoints(spec, now)
        self.apply_override(policy, now)

    def _sync_endpoints(self, spec: Backend, now: float) -> None:
        if self.endpoints is not None:
            # Leaving the pool drains: an endpoint with requests in flight stays until they finish.
            self.endpoints.sync(spec, now)
        elif spec.is_pool:
            self.endpoints = EndpointSet.create(spec, now)

    def _requeue(self, policy: Policy, now: float) -> None:
        # Waiters keep waiting on their futures; only the queue's bookkeeping is rebuilt.
        self.configs = _queue_configs(policy)
        new: AdmissionQueue[int] = AdmissionQueue(self.configs)
        for w in sorted(self.waiters.values(), key=lambda w: w.id):
            if w.tier not in policy.tiers or not isinstance(new.enqueue(w.id, w.tier, now), Enqueued):
                self._resolve(w, Denied("queue_full", "tier removed or queue shrank"))
        self.queue = new

    def apply_override(self, policy: Policy, now: float, wall: float | None = None) -> None:
        """Apply the policy's manual trips/resets for this backend and its routes, once per change."""
        mine = {o.model: o for o in policy.breakers if o.backend == self.spec.name}
        wall = wall if wall is not None else time.time()
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
        if self.latency is not None:
            scale = min(scale, self.latency.scale(now))
        return scale

    def pressure_scale(self, tier: str, now: float) -> float:
        """The scale a tier's degradation ladder sees.

        KV-aware admission keeps the cache under the watermark, so the watermark
        alone rarely signals pressure; a more important tier waiting in our own queue
        does, and so does a more important tier missing its latency SLO. Then lower
        tiers are degraded or shed as at the high mark.
        """
        scale = self.scale(now)
        if self.waiters and self._waiting_above(tier):
            scale = min(scale, self.spec.watermark.floor)
        if self.latency is not None and self._slo_risk_above(tier, now):
            scale = min(scale, self.spec.watermark.floor)
        return scale

    def _slo_risk_above(self, tier: str, now: float) -> bool:
        assert self.latency is not None
        mine = self.priorities.get(tier, 0)
        return any(p > mine and self.latency.at_risk(t, now) for t, p in self.priorities.items())

    def _waiting_above(self, tier: str) -> bool:
        mine = self.priorities.get(tier, 0)
        return any(self.priorities.get(w.tier, 0) > mine and not w.future.done() for w in self.waiters.values())

    # -- KV budget ------------------------------------------------------------------
    def footprint(self, tokens: int) -> int:
        """KV tokens a request may occupy, rounded up to whole cache blocks."""
        bs = self.spec.kv_block_size
        return -(-tokens // bs) * bs

    def kv_budget(self, now: float) -> float:
        cap = self.spec.kv_capacity_tokens
        if cap is None:
            return float("inf")
        budget = cap * self.spec.kv_overcommit * self.scale(now)
        return budget if self.kv_lease is None else min(budget, self.kv_lease)

    def kv_fits(self, kv: int, now: float, tier: str | None = None) -> bool:
        """Whether ``kv`` more tokens fit, leaving room a more important waiter is owed.

        Without that reservation a queued premium request needing a large footprint
        is overtaken forever by small free-tier requests that each fit in the room
        freed so far (priority inversion under KV pressure).
        """
        owed = self._kv_owed_above(tier, now) if tier is not None else 0
        if self.kv_in_use + kv + owed <= self.kv_budget(now):
            return True
        # A lone request always fits a scaled-down budget if it fits the whole cache:
        # otherwise a large prompt could starve forever while the scale is low.
        cap = self.spec.kv_capacity_tokens
        return (self.kv_in_use == 0 and cap is not None
                and kv <= (cap if self.kv_lease is None else min(cap, self.kv_lease)))

    def _kv_owed_above(self, tier: str, now: float) -> int:
        """The KV need of the most important waiter, of a tier above ``tier``, that does not fit."""
        if not self.waiters or self.spec.kv_capacity_tokens is None:
            return 0
        mine = self.priorities.get(tier, 0)
        budget = self.kv_budget(now)
        best: Waiter | None = None
        for w in self.waiters.values():
            p = self.priorities.get(w.tier, 0)
            if p > mine and not w.future.done() and self.kv_in_use + w.kv > budget and \
                    (best is None or p > self.priorities.get(best.tier, 0)):
                best = w
        return best.kv if best is not None else 0

    # -- acquisition ----------------------------------------------------------------
    def try_acquire(self, tier: str, tenant: str, cap: int | None, kv: int, now: float) -> Hold | Denied:
        got = self._try_acquire(tier, tenant, cap, kv, now)
        if self.on_short is not None and isinstance(got, Denied) and got.reason != REASON_TENANT_CAP:
            self.on_short(self, kv, now)
        return got

    def _try_acquire(self, tier: str, tenant: str, cap: int | None, kv: int, now: float) -> Hold | Denied:
        # Waiting requests get free capacity first; a newcomer never overtakes its own
        # tier's queue (FIFO within a tier), but may take a slot no waiter can use,
        # e.g. a premium guaranteed slot while free-tier requests wait for shared ones.
        if self.queue.depth():
            self.pump(now)
            if self.queue.depth(tier):
                return Denied("slots_exhausted", "requests of this tier are already waiting")
        return self._take(tier, tenant, cap, kv, now)

    def _take(self, tier: str, tenant: str, cap: int | None, kv: int, now: float) -> Hold | Denied:
        if not self.kv_fits(kv, now, tier):
            return Denied("kv_exhausted", f"KV budget: {self.kv_in_use} + {kv} > {self.kv_budget(now):.0f}")
        got = self.pool.try_acquire(tier, tenant, cap, self.slot_scale(now))
        if isinstance(got, Denied):
            return got
        endpoint = None
        if self.endpoints is not None:
            placed = self.endpoints.place(kv, now)
            if placed is None:
                self.pool.release(got)
                return Denied("kv_exhausted", f"a footprint of {kv} tokens fits on no endpoint of the pool now")
            endpoint = placed.key
        self.kv_in_use += kv
        return Hold(got, kv, endpoint)

    def can_admit(self, tier: str, now: float) -> bool:
        head = next((w for w in self.waiters.values() if w.tier == tier and not w.future.done()), None)
        if head is not None and not self.kv_fits(head.kv, now, tier):
            return False
        if head is not None and self.endpoints is not None and not self.endpoints.fits_somewhere(head.kv, now):
            return False
        got = self.pool.try_acquire(tier, _PROBE_TENANT, None, self.slot_scale(now))
        if isinstance(got, SlotGrant):
            self.pool.release(got)
            return True
        return False

    def enqueue(self, tier: str, tenant: str, cap: int | None, kv: int, now: float) -> Waiter | str:
        wid = next(_ids)
        res = self.queue.enqueue(wid, tier, now)
        if not isinstance(res, Enqueued):
            return res.reason
        fut: asyncio.Future[Hold | Denied] = asyncio.get_running_loop().create_future()
        w = self.waiters[wid] = Waiter(wid, tier, tenant, cap, kv, fut)
        return w

    def leave(self, w: Waiter) -> None:
        """A waiter gives up (deadline or disconnect); a grant already handed over goes back."""
        self.queue.remove(w.id)
        self.waiters.pop(w.id, None)
        if w.future.done() and not w.future.cancelled():
            got = w.future.result()
            if isinstance(got, Hold):
                self._give_back(got)
        elif not w.future.done():
            w.future.cancel()

    def pump(self, now: float) -> int:
        """Hand free slots to waiting requests, fairly across tiers. Returns how many."""
        handed = 0
        while self.queue.depth():
            wid = self.queue.next_eligible(lambda tier: self.can_admit(tier, now), now)
            if wid is None:
                break
            w = self.waiters.get(wid)
            if w is None or w.future.done():
                continue
            self._resolve(w, self._take(w.tier, w.tenant, w.tenant_cap, w.kv, now))
            handed += 1
        return handed

    def _resolve(self, w: Waiter, got: Hold | Denied) -> None:
        self.waiters.pop(w.id, None)
        self.queue.remove(w.id)
        if w.future.done():
            if isinstance(got, Hold):
                self._give_back(got)
            return
        w.future.set_result(got)

    def _give_back(self, hold: Hold) -> None:
        self.pool.release(hold.grant)
        self.kv_in_use -= hold.kv
        if hold.endpoint is not None and self.endpoints is not None:
            self.endpoints.release(hold.endpoint, hold.kv)

    def release(self, hold: Hold, now: float) -> None:
        self._give_back(hold)
        self.pump(now)


def _queue_configs(policy: Policy) -> dict[str, TierQueueConfig]:
    return {name: TierQueueConfig(max_depth=t.max_queue_depth, max_wait_s=t.max_queue_wait_ms / 1000.0,
                                  weight=float(t.queue_weight), priority=t.priority)
            for name, t in policy.tiers.items()}


def _burst_caps(policy: Policy) -> dict[str, int]:
    return {name: t.burst_slots for name, t in policy.tiers.items() if t.burst_slots is not None}
