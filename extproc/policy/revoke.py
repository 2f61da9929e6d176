"""Taking KV room back from lower tiers: who gives it up, in order of least harm. Pure.

A waiting request of a tier with a KV guarantee (``extproc.policy.kv_shares``) that does
not fit may have room taken back from requests of lower tiers already admitted:

* always while its tier is within its guarantee (the room is the tier's; lower tiers only
  borrowed it while the tier was idle);
* above its guarantee only while its tier's latency SLO is at risk (``slo_at_risk``: the
  adaptive limit says so, ``BackendView.slo_at_risk``, or the waiter has waited a quarter
  of its tier's ``ttft_p99_ms``: the SLO counts from admission, but the client's wait
  started earlier): the burst room is shared, and taking it costs work.

Who may be revoked: requests of tiers of lower priority, and only the room they hold
above their own tier's guarantee (a guarantee protects a tier from every other, whatever
its priority). A request whose client has seen output may be revoked only if its tier is
``revocable``; one that has not may always be (its client gets a retryable 503 and is
not billed). On a pool endpoint only requests placed there free room there.

Least harm first: requests that have not produced anything before those that have; then
the lowest tier; then the least work thrown away (prompt tokens prefilled plus tokens
generated, as the caller estimates them); then the most recently admitted. The victims
are taken in that order until the room is freed, then those not needed are given back
(the most harmful first). Nothing is revoked when even every candidate would not free
enough: the waiter would not be helped and the work would be lost.

``freed`` counts only room the waiter can use: a victim's tier that stays active keeps
its guarantee, so taking it below its guarantee frees nothing for the waiter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.policy.kv import kv_budget, kv_owed_above
from extproc.policy.kv_shares import KvShare, burst_room, guaranteed_tokens, reserved_for_others
from extproc.policy.view import BackendView

__all__ = ["WAIT_AT_RISK", "Need", "Running", "plan", "should_revoke", "shortfall", "slo_at_risk"]

# A waiter that has waited this share of its tier's TTFT SLO puts the SLO at risk.
WAIT_AT_RISK = 0.25


@dataclass(frozen=True, slots=True)
class Running:
    """An admitted request that could give its room back."""

    id: int
    tier: str
    kv: int  # its reserved footprint
    producing: bool  # its client has seen output (a token, or a non-streaming response)
    waste: int  # work thrown away if it ends now: prompt tokens prefilled plus tokens generated
    admitted_at: float
    endpoint: str | None = None  # where it was placed in a pool


@dataclass(frozen=True, slots=True)
class Need:
    """Room a waiting request lacks."""

    tier: str
    kv: int  # tokens to free
    endpoint: str | None = None  # in a pool: the endpoint the room must come from


def slo_at_risk(controller_says: bool, waited_s: float, ttft_slo_ms: int | None) -> bool:
    """Whether a waiter's latency SLO is at risk: the adaptive limit says so, or its wait has
    used ``WAIT_AT_RISK`` of the tier's ``ttft_p99_ms``."""
    return controller_says or (
        ttft_slo_ms is not None and waited_s * 1000 >= WAIT_AT_RISK * ttft_slo_ms
    )


def should_revoke(
    shares: Mapping[str, KvShare],
    held: Mapping[str, int],
    tier: str,
    kv: int,
    budget: float,
    slo_at_risk: bool,
) -> bool:
    """Whether a waiter of ``tier`` with footprint ``kv`` may take room back."""
    share = shares.get(tier)
    if share is None or share.guaranteed <= 0 or kv > burst_room(share, held.get(tier, 0), budget):
        return False
    return held.get(tier, 0) + kv <= guaranteed_tokens(share, budget) or slo_at_risk


def shortfall(view: BackendView, tier: str, kv: int, now: float) -> int:
    """The KV tokens a request of ``tier`` with footprint ``kv`` lacks on ``view`` now: what
    must be freed before it fits the budget beside the other tiers' guarantees and the room
    owed to a more important waiter (``extproc.policy.kv.kv_fits``, without its lone-request
    exception: revocation never empties a cache for one request)."""
    budget = kv_budget(view, now)
    if budget == float("inf"):
        return 0
    reserved = (
        reserved_for_others(view.kv_shares, view.kv_by_tier, view.kv_active(now), budget, tier)
        if view.kv_shares
        else 0.0
    )
    owed = kv_owed_above(view, tier, now)
    return max(0, math.ceil(view.kv_in_use + kv + reserved + owed - budget))


def _order(r: Running, priorities: Mapping[str, int]) -> tuple[bool, int, int, float, int]:
    return (r.producing, priorities.get(r.tier, 0), r.waste, -r.admitted_at, r.id)


def plan(
    candidates: Iterable[Running],
    need: Need,
    priorities: Mapping[str, int],
    revocable: Mapping[str, bool],
    shares: Mapping[str, KvShare],
    held: Mapping[str, int],
    active: Mapping[str, bool],
    budget: float,
) -> tuple[Running, ...]:
    """The requests to revoke so that ``need`` is met, least harmful first; () if it cannot be."""
    if need.kv <= 0:
        return ()
    mine = priorities.get(need.tier, 0)
    eligible = sorted(
        (
            r
            for r in candidates
            if priorities.get(r.tier, 0) < mine
            and (not r.producing or revocable.get(r.tier, False))
            and (need.endpoint is None or r.endpoint == need.endpoint)
        ),
        key=lambda r: _order(r, priorities),
    )
    chosen: list[Running] = []
    for r in eligible:
        if _freed(chosen, shares, held, active, budget) >= need.kv:
            break
        if _freed([*chosen, r], shares, held, active, budget) > _freed(
            chosen, shares, held, active, budget
        ):
            chosen.append(r)
    if _freed(chosen, shares, held, active, budget) < need.kv:
        return ()
    for r in reversed(list(chosen)):  # give back what is not needed, most harmful first
        rest = [c for c in chosen if c is not r]
        if _freed(rest, shares, held, active, budget) >= need.kv:
            chosen = rest
    return tuple(chosen)


def _freed(
    victims: Sequence[Running],
    shares: Mapping[str, KvShare],
    held: Mapping[str, int],
    active: Mapping[str, bool],
    budget: float,
) -> int:
    """Room the waiter gains when ``victims`` end: per tier, what they hold above the part of
    the tier's guarantee it keeps (an active tier keeps it)."""
    taken: dict[str, int] = {}
    for v in victims:
        taken[v.tier] = taken.get(v.tier, 0) + v.kv
    out = 0
    for tier, kv in taken.items():
        g = guaranteed_tokens(shares.get(tier), budget) if active.get(tier, False) else 0.0
        above = max(0.0, held.get(tier, 0) - g)
        out += int(min(kv, above))
    return out
