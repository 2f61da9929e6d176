"""Concurrency slot pools for one backend: guaranteed slots per tier plus a shared pool.

A backend's concurrency budget ``total`` (its max batch) is split into slots
guaranteed to each tier (usable only by that tier) and a burstable shared pool of
``total - sum(guaranteed)`` that any tier may borrow from, up to an optional
per-tier burst cap. A per-tenant cap keeps one tenant from taking a whole tier or
the pool.

Watermark scaling (``scale`` in [0, 1]) shrinks the effective budget to
``round_half_up(total * scale)``. The cut comes out of the shared pool first (it is
the borrowed, least-promised capacity), then out of the guaranteed slots of the
lowest-priority tier upward, so the top tier's guarantee is the last to go. Held
slots are never revoked: when the budget falls below what is in use, new
acquisitions are refused until releases bring usage under it.

Pure: no I/O, no clock, no threads (callers serialise access).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from extproc.policy.reasons import Cause

__all__ = [
    "Denied",
    "Limits",
    "SlotGrant",
    "SlotPool",
    "SlotReleaseError",
    "SlotUsage",
]

PoolName = Literal["guaranteed", "shared"]

_pool_serials = itertools.count(1)


class SlotReleaseError(RuntimeError):
    """A grant was released twice, or released to a pool that did not issue it."""


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """A held slot. Release it exactly once, to the pool that issued it."""

    id: int
    tier: str
    tenant: str
    pool: PoolName
    issuer: int  # serial of the issuing SlotPool, to catch cross-pool releases


@dataclass(frozen=True, slots=True)
class Denied:
    """A refused acquisition. ``reason`` is a metric label; ``detail`` is for humans."""

    reason: Cause
    detail: str


class Limits(TypedDict):
    """Effective limits at one scale: the budget, the shared pool, each tier's guarantee."""

    total: int
    shared: int
    guaranteed: dict[str, int]


@dataclass(frozen=True, slots=True)
class SlotUsage:
    """Slots in use, for metrics: totals per pool, per tier and per tenant."""

    total: int
    shared: int
    guaranteed: Mapping[str, int]  # tier -> guaranteed slots held
    shared_by_tier: Mapping[str, int]  # tier -> shared slots held
    by_tier: Mapping[str, int]
    by_tenant: Mapping[str, int]


def round_half_up(x: float) -> int:
    # Python's round() rounds half to even (round(2.5) == 2); operators expect 2.5 -> 3.
    return math.floor(x + 0.5)


class SlotPool:
    """Guaranteed-per-tier plus burstable shared concurrency slots for one backend."""

    def __init__(
        self,
        total: int,
        guaranteed: Mapping[str, int],
        tier_order: Sequence[str],
        burst_caps: Mapping[str, int] | None = None,
    ) -> None:
        self._serial = next(_pool_serials)
        self._ids = itertools.count(1)
        self._grants: dict[int, SlotGrant] = {}
        # Usage counters are keyed by name, independent of the configuration, so grants
        # made under an old configuration stay releasable after reconfigure().
        self._held_guaranteed: Counter[str] = Counter()
        self._held_shared: Counter[str] = Counter()
        self._held_tenant: Counter[str] = Counter()
        self._total = 0
        self._guaranteed: dict[str, int] = {}
        self._tier_order: tuple[str, ...] = ()
        self._burst_caps: dict[str, int] = {}
        self.reconfigure(total, guaranteed, tier_order, burst_caps)

    # -- configuration -----------------------------------------------------------------

    def reconfigure(
        self,
        total: int,
        guaranteed: Mapping[str, int],
        tier_order: Sequence[str] | None = None,
        burst_caps: Mapping[str, int] | None = None,
    ) -> None:
        """Replace the configuration, keeping every held grant (and its pool) as is.

        ``tier_order`` defaults to the current one; ``burst_caps`` is replaced
        (None means no caps).
        """
        order = tuple(self._tier_order if tier_order is None else tier_order)
        if not order:
            raise ValueError("tier_order must name at least one tier")
        if len(set(order)) != len(order):
            raise ValueError(f"tier_order has duplicates: {order}")
        _check_count("total", total)
        for tier, n in guaranteed.items():
            if tier not in order:
                raise ValueError(f"guaranteed slots for unknown tier {tier!r}")
            _check_count(f"guaranteed[{tier!r}]", n)
        caps = dict(burst_caps or {})
        for tier, n in caps.items():
            if tier not in order:
                raise ValueError(f"burst cap for unknown tier {tier!r}")
            _check_count(f"burst_caps[{tier!r}]", n)
        if sum(guaranteed.values()) > total:
            raise ValueError(
                f"guaranteed slots ({sum(guaranteed.values())}) exceed total ({total})"
            )
        self._total = total
        self._tier_order = order
        self._guaranteed = {tier: int(guaranteed.get(tier, 0)) for tier in order}
        self._burst_caps = caps

    @property
    def total(self) -> int:
        return self._total

    @property
    def tier_order(self) -> tuple[str, ...]:
        return self._tier_order

    def effective_limits(self, scale: float = 1.0) -> Limits:
        """The limits ``try_acquire`` applies at ``scale`` (see the module docstring)."""
        _check_scale(scale)
        budget = round_half_up(self._total * scale)
        cut = self._total - budget
        base_shared = self._total - sum(self._guaranteed.values())
        from_shared = min(cut, base_shared)
        cut -= from_shared
        guaranteed = dict(self._guaranteed)
        for tier in reversed(self._tier_order):  # lowest priority gives up slots first
            if cut <= 0:
                break
            taken = min(cut, guaranteed[tier])
            guaranteed[tier] -= taken
            cut -= taken
        return Limits(total=budget, shared=base_shared - from_shared, guaranteed=guaranteed)

    # -- acquire / release -------------------------------------------------------------

    def try_acquire(
        self,
        tier: str,
        tenant: str,
        tenant_cap: int | None = None,
        scale: float = 1.0,
    ) -> SlotGrant | Denied:
        """Take a slot: the tier's guaranteed pool first, then the shared pool.

        ``tenant_cap`` (None = uncapped) bounds the slots ``tenant`` holds in this
        pool, across tiers. It is not scaled here; a caller that wants caps to
        shrink with the watermark passes a scaled cap.
        """
        got = self.slot_for(tier, tenant, tenant_cap, scale)
        return got if isinstance(got, Denied) else self.grant(tier, tenant, got)

    def slot_for(
        self,
        tier: str,
        tenant: str,
        tenant_cap: int | None = None,
        scale: float = 1.0,
    ) -> PoolName | Denied:
        """The pool ``try_acquire`` would take a slot from, or why not; takes nothing."""
        if tier not in self._guaranteed:
            raise ValueError(f"unknown tier {tier!r}; known: {self._tier_order}")
        if tenant_cap is not None:
            _check_count("tenant_cap", tenant_cap)
            if self._held_tenant[tenant] >= tenant_cap:
                return Denied(
                    Cause.SLOTS_TENANT_CAP,
                    f"tenant {tenant!r} holds {self._held_tenant[tenant]} of {tenant_cap} slots",
                )
        limits = self.effective_limits(scale)
        in_use = len(self._grants)
        if in_use >= limits["total"]:
            # Shrunk below usage (or simply full): nothing new until usage drops, even
            # for a tier whose own guarantee looks free. Memory safety beats the promise.
            return Denied(Cause.SLOTS_EXHAUSTED, f"{in_use} slots in use, budget {limits['total']}")
        if self._held_guaranteed[tier] < limits["guaranteed"][tier]:
            return "guaranteed"
        shared_in_use = sum(self._held_shared.values())
        if shared_in_use >= limits["shared"]:
            return Denied(
                Cause.SLOTS_EXHAUSTED,
                f"tier {tier!r} guaranteed slots full and shared pool full "
                f"({shared_in_use}/{limits['shared']})",
            )
        cap = self._burst_caps.get(tier)
        if cap is not None and self._held_shared[tier] >= cap:
            return Denied(
                Cause.SLOTS_EXHAUSTED,
                f"tier {tier!r} guaranteed slots full and burst cap reached "
                f"({self._held_shared[tier]}/{cap})",
            )
        return "shared"

    def grant(self, tier: str, tenant: str, pool: PoolName) -> SlotGrant:
        """Take the slot ``slot_for`` just named, with nothing changed in between."""
        grant = SlotGrant(
            id=next(self._ids), tier=tier, tenant=tenant, pool=pool, issuer=self._serial
        )
        self._grants[grant.id] = grant
        held = self._held_guaranteed if pool == "guaranteed" else self._held_shared
        held[tier] += 1
        self._held_tenant[tenant] += 1
        return grant

    def release(self, grant: SlotGrant) -> None:
        """Return ``grant`` to the pool it came from. Raises on a second release."""
        if grant.issuer != self._serial or self._grants.get(grant.id) != grant:
            raise SlotReleaseError(f"grant not held by this pool (double release?): {grant}")
        del self._grants[grant.id]
        held = self._held_guaranteed if grant.pool == "guaranteed" else self._held_shared
        _decrement(held, grant.tier)
        _decrement(self._held_tenant, grant.tenant)

    # -- reporting ---------------------------------------------------------------------

    def in_use(self) -> SlotUsage:
        """What is held now. Every configured tier appears (with 0s) so metric label
        sets stay stable; tiers dropped by reconfigure() appear while still held."""
        tiers = list(self._tier_order) + sorted(
            (set(self._held_guaranteed) | set(self._held_shared)) - set(self._tier_order)
        )
        return SlotUsage(
            total=len(self._grants),
            shared=sum(self._held_shared.values()),
            guaranteed={t: self._held_guaranteed[t] for t in tiers},
            shared_by_tier={t: self._held_shared[t] for t in tiers},
            by_tier={t: self._held_guaranteed[t] + self._held_shared[t] for t in tiers},
            by_tenant=dict(self._held_tenant),
        )

    def snapshot(self, scale: float = 1.0) -> dict[str, Any]:
        """A JSON-ready view of configuration, effective limits and usage."""
        usage = self.in_use()
        return {
            "total": self._total,
            "tier_order": list(self._tier_order),
            "guaranteed": dict(self._guaranteed),
            "burst_caps": dict(self._burst_caps),
            "scale": scale,
            "effective": self.effective_limits(scale),
            "in_use": {
                "total": usage.total,
                "shared": usage.shared,
                "guaranteed": dict(usage.guaranteed),
                "shared_by_tier": dict(usage.shared_by_tier),
                "by_tier": dict(usage.by_tier),
                "by_tenant": dict(usage.by_tenant),
            },
        }


def _check_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


def _check_scale(scale: float) -> None:
    if not 0.0 <= scale <= 1.0:  # also rejects NaN
        raise ValueError(f"scale must be in [0, 1], got {scale!r}")


def _decrement(counter: Counter[str], key: str) -> None:
    # Drop zero entries so in_use() reports only what is held.
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
