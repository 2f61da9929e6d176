"""The slot-and-KV decision for one request: ``decide(view, request, now) -> Decision``.

In order, cheapest refusal first:

1. A footprint larger than the largest single cache can never run: ``Reject``
   (``too_large_for_backend``), whatever the load.
2. A tier whose queue is not empty keeps its order: a newcomer waits behind it, unless
   fair share by work puts its tenant first (its tenant has nothing queued and was
   given less work than every waiting tenant of the tier, ``extproc.policy.fair_share``).
   It may still take a slot no waiter of its tier can use, e.g. a premium guaranteed
   slot while free-tier requests wait for shared ones. (In a pool the queue may look
   past a head that fits no endpoint: ``extproc.policy.owed``.)
3. KV: the footprint must fit the budget, leaving what a more important waiter is
   owed and the other tiers' guarantees (``extproc.policy.kv``, ``extproc.policy.kv_shares``).
4. A slot: the tenant's cap, then the tier's guarantee, then the shared pool, at the
   slot scale (``extproc.policy.slots``).

A request that may not have room now waits (``Queue``) if its tier has a queue, and
is refused otherwise; a tenant over its concurrency cap is refused at once (a wait
would not free one of its own slots sooner than it would itself).

Pure: reads a ``BackendView``; the caller applies an ``Admit`` (takes the slot,
reserves the KV, places it on a pool endpoint) with nothing changed in between.
"""

from __future__ import annotations

from typing import NamedTuple

from extproc.policy.decision import ADMIT, Admit, Decision, Queue, Reject
from extproc.policy.kv import kv_budget, kv_fits
from extproc.policy.reasons import Cause, Reason
from extproc.policy.slots import Denied
from extproc.policy.view import BackendView

__all__ = ["SlotRequest", "can_admit", "decide", "refused", "take"]

PROBE_TENANT = "\x00probe"  # asks for a slot as no tenant: never capped


class SlotRequest(NamedTuple):
    tier: str
    tenant: str
    tenant_cap: int | None  # the tenant's max_concurrency (None: uncapped)
    kv: int  # the footprint, in whole blocks (extproc.policy.kv.footprint)
    may_queue: bool = True  # the tier has a queue (max_queue_depth and max_queue_wait_ms > 0)
    work: float = 0.0  # its fair-share work (extproc.policy.fair_share.work)


def decide(view: BackendView, req: SlotRequest, now: float) -> Decision:
    cap = view.largest_kv_capacity
    if cap is not None and req.kv > cap:
        return Reject(Reason.TOO_LARGE_FOR_BACKEND,
                      f"The request may need {req.kv} tokens of KV cache; backend {view.name!r} has {cap}. "
                      "Lower max_tokens or shorten the prompt.",
                      code="context_length_exceeded", param="max_tokens")
    if view.waiters and view.queued(req.tier) and not view.leads(req.tier, req.tenant, req.work):
        return refused(req, Denied(Cause.SLOTS_EXHAUSTED, "requests of this tier are already waiting"))
    got = take(view, req.tier, req.tenant, req.tenant_cap, req.kv, now)
    return got if isinstance(got, Admit) else refused(req, got)


def take(view: BackendView, tier: str, tenant: str, tenant_cap: int | None, kv: int, now: float) -> Admit | Denied:
    """Room for ``kv`` and a slot now, or why not (also what a waiter gets when the queue pumps)."""
    if not kv_fits(view, kv, now, tier, tenant):
        return Denied(Cause.KV_EXHAUSTED, f"KV budget: {view.kv_in_use} + {kv} > {kv_budget(view, now):.0f}")
    pool = view.slot_for(tier, tenant, tenant_cap, view.slot_scale(now))
    if isinstance(pool, Denied):
        return pool
    return ADMIT[pool]


def refused(req: SlotRequest, why: Denied) -> Queue | Reject:
    """A request with no room now: it waits, or (over its tenant's cap, or no queue) it is refused."""
    if why.reason == Cause.SLOTS_TENANT_CAP:
        return Reject(Reason.SLOTS, f"Too many concurrent requests for this key (limit {req.tenant_cap}).",
                      code="rate_limit_exceeded", cause=Cause.SLOTS_TENANT_CAP, retry_after_s=1)
    if not req.may_queue:
        return Reject(Reason.SLOTS, "The backend is at its concurrency limit; retry shortly.",
                      code="rate_limit_exceeded", cause=why.reason, retry_after_s=1)
    return Queue(why.reason, why.detail)


def can_admit(
    view: BackendView, tier: str, head_kv: int | None, now: float, tenant: str | None = None
) -> bool:
    """Whether the head of ``tier``'s queue (footprint ``head_kv``, of ``tenant``; None: no live
    head) could go now."""
    if head_kv is not None and not (
        kv_fits(view, head_kv, now, tier, tenant) and view.fits_somewhere(head_kv, now, tier)
    ):
        return False
    return not isinstance(view.slot_for(tier, PROBE_TENANT, None, view.slot_scale(now)), Denied)
