"""The KV-cache arithmetic of admission: footprints, the budget, the owed-KV rule, pressure.

A request reserves its worst-case footprint (prompt + completions, rounded up to whole
cache blocks) while it runs. The reservations of a backend stay within its budget,
``kv_capacity x kv_overcommit x watermark scale`` (and the replica's lease of a shared
pool), with two rules on top:

* Owed KV: room a more important waiter needs and does not get is kept free, so a
  large premium request is not overtaken forever by small lower-tier ones that each
  fit in the room freed so far (priority inversion under KV pressure). Here it
  guards the backend's (a pool's: the summed) budget; in a pool the room must also
  accumulate on one endpoint, which ``extproc.policy.owed`` keeps.
* A lone request always fits a scaled-down budget if it fits the whole cache (or
  the lease): otherwise a large prompt could starve forever while the scale is low.
* KV shares (``extproc.policy.kv_shares``): a tier's reservation leaves the unused
  guarantees of the other active tiers free and stays under its own burst cap; a lone
  request is judged against the whole cache, as above.
* Peer headroom (``extproc.policy.fair_share``): a tenant's reservation leaves the room
  its tier's less-served tenants recently needed (at most half of the budget), so a light
  tenant does not wait for a heavy one's requests to end.

Pure: reads a ``BackendView``; ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.policy.fair_share import PEER_HEADROOM_CAP
from extproc.policy.kv_shares import share_denial
from extproc.policy.view import BackendView

__all__ = ["footprint", "kv_budget", "kv_fits", "kv_owed_above", "pressure_scale"]


def footprint(tokens: int, block_size: int) -> int:
    """KV tokens a request may occupy: ``tokens`` rounded up to whole cache blocks."""
    return -(-tokens // block_size) * block_size


def kv_budget(view: BackendView, now: float) -> float:
    cap = view.kv_capacity
    if cap is None:
        return float("inf")
    budget = cap * view.kv_overcommit * view.scale(now)
    lease = view.kv_lease
    return budget if lease is None else min(budget, lease)


def kv_owed_above(view: BackendView, tier: str, now: float) -> int:
    """The KV need of the most important waiter, of a tier above ``tier``, that does not fit."""
    waiting = view.waiting() if view.waiters else ()
    if not waiting:
        return 0
    return _owed(view, waiting, tier, view.kv_in_use, kv_budget(view, now))


def _owed(view: BackendView, waiting: Sequence[tuple[str, int]], tier: str, in_use: int, budget: float) -> int:
    if view.kv_capacity is None:
        return 0
    prio = view.priorities
    mine = prio.get(tier, 0)
    best_p, best_kv = 0, 0
    found = False
    for t, kv in waiting:
        p = prio.get(t, 0)
        if p > mine and in_use + kv > budget and (not found or p > best_p):
            best_p, best_kv, found = p, kv, True
    return best_kv


def kv_fits(
    view: BackendView, kv: int, now: float, tier: str | None = None, tenant: str | None = None
) -> bool:
    """Whether ``kv`` more tokens fit, leaving the room a more important waiter is owed,
    the other tiers' guarantees, and (with ``tenant``) its tier's less-served tenants' headroom."""
    in_use = view.kv_in_use
    budget = kv_budget(view, now)
    if (
        tier is not None
        and view.kv_shares
        and not _shares_allow(view, kv, now, tier, in_use, budget)
    ):
        return False
    owed = 0
    if tenant is not None and tier is not None and in_use and budget != float("inf"):
        owed = min(view.peer_headroom(tier, tenant, now), int(PEER_HEADROOM_CAP * budget))
    if tier is not None and view.waiters:
        waiting = view.waiting()
        if waiting:
            owed += _owed(view, waiting, tier, in_use, budget)
    if in_use + kv + owed <= budget:
        return True
    cap = view.kv_capacity
    if in_use != 0 or cap is None:
        return False
    lease = view.kv_lease
    return kv <= (cap if lease is None else min(cap, lease))


def _shares_allow(
    view: BackendView, kv: int, now: float, tier: str, in_use: int, budget: float
) -> bool:
    limit = budget
    cap = view.kv_capacity
    if in_use == 0 and cap is not None:  # the lone-request rule: the whole cache (or lease)
        lease = view.kv_lease
        limit = max(budget, cap if lease is None else min(cap, lease))
    return (
        share_denial(view.kv_shares, view.kv_by_tier, view.kv_active(now), limit, in_use, tier, kv)
        is None
    )


def pressure_scale(view: BackendView, tier: str, now: float) -> float:
    """The scale a tier's degradation ladder sees.

    KV-aware admission keeps the cache under the watermark, so the watermark alone
    rarely signals pressure; a more important tier waiting in our own queue does, and
    so does a more important tier missing its latency SLO. Then lower tiers are
    degraded or shed as at the high mark.
    """
    scale = view.scale(now)
    waiting = view.waiting() if view.waiters else ()
    has_slo = view.has_slo
    if not waiting and not has_slo:
        return scale
    prio = view.priorities
    mine = prio.get(tier, 0)
    if waiting and any(prio.get(t, 0) > mine for t, _ in waiting):
        scale = min(scale, view.floor)
    if has_slo and any(p > mine and view.slo_at_risk(t, now) for t, p in prio.items()):
        scale = min(scale, view.floor)
    return scale
