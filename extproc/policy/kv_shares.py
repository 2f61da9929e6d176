"""Per-tier KV guarantees on one cache: a share lower tiers cannot reserve, and a burst cap.

Slots have guarantees per tier plus a shared pool (``extproc.policy.slots``); without the
same for KV the first tier to arrive can reserve the whole cache, and a burst of long
documents leaves the premium tier the room of a few chats (seed 002's disaster, moved
from the engine into Sluice's queue). A tier's KV share is set as fractions of the
backend's (or pool endpoint's) KV budget, so it follows the watermark and a shared
store's lease the way the budget does:

* ``kv_guaranteed``: the fraction of the budget kept for the tier while it has demand.
  Another tier may reserve only what leaves every other *active* tier's unused guarantee
  free. An idle tier (nothing reserved, nothing waiting, nothing seen for ``DEMAND_HOLD_S``)
  lends its guarantee: the room is not wasted while nobody of the tier is there, and a
  request that borrowed it can be revoked when the tier comes back
  (``extproc.policy.revoke``).
* ``kv_burst``: the most of the budget a tier may hold above its guarantee (None: no cap).

The tier's own guarantee does not cap it: above it, the tier competes for the rest like
every other. A guarantee is not a promise that room is free, only that lower tiers do not
take it; what the tier itself (or an earlier idle period) let others hold comes back as
they finish, or by revocation.

Pure: values in, a number or a reason out; ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEMAND_HOLD_S",
    "KvShare",
    "borrowed",
    "burst_room",
    "guaranteed_tokens",
    "reserved_for_others",
    "share_denial",
    "tier_active",
]

# A tier keeps its guarantee this long after its last request was seen: steady chat has
# gaps between requests, and a document slipping into a gap would take the room back.
DEMAND_HOLD_S = 5.0


@dataclass(frozen=True, slots=True)
class KvShare:
    guaranteed: float = 0.0  # fraction of the KV budget
    burst: float | None = None  # most of the budget held above the guarantee; None: uncapped

    def __post_init__(self) -> None:
        if not 0.0 <= self.guaranteed <= 1.0:
            raise ValueError(f"kv_guaranteed must be in [0, 1], got {self.guaranteed!r}")
        if self.burst is not None and not 0.0 <= self.burst <= 1.0:
            raise ValueError(f"kv_burst must be in [0, 1], got {self.burst!r}")


def guaranteed_tokens(share: KvShare | None, budget: float) -> float:
    if share is None or budget == float("inf"):
        return 0.0
    return share.guaranteed * budget


def tier_active(held: int, waiting: int, last_seen: float | None, now: float) -> bool:
    """Whether a tier has demand: room reserved, a request waiting, or one seen recently."""
    return held > 0 or waiting > 0 or (last_seen is not None and now - last_seen < DEMAND_HOLD_S)


def reserved_for_others(
    shares: Mapping[str, KvShare],
    held: Mapping[str, int],
    active: Mapping[str, bool],
    budget: float,
    tier: str,
) -> float:
    """The unused guaranteed room of every other active tier: what ``tier`` may not reserve."""
    if budget == float("inf"):
        return 0.0
    out = 0.0
    for t, s in shares.items():
        if t != tier and s.guaranteed > 0 and active.get(t, False):
            out += max(0.0, s.guaranteed * budget - held.get(t, 0))
    return out


def borrowed(share: KvShare | None, held: int, budget: float) -> float:
    """How much of what a tier holds is above its guarantee (what revocation may take back)."""
    return max(0.0, held - guaranteed_tokens(share, budget))


def burst_room(share: KvShare | None, held: int, budget: float) -> float:
    """How many more tokens the tier may reserve before its burst cap (inf: uncapped)."""
    if share is None or share.burst is None or budget == float("inf"):
        return float("inf")
    return share.guaranteed * budget + share.burst * budget - held


def share_denial(
    shares: Mapping[str, KvShare],
    held: Mapping[str, int],
    active: Mapping[str, bool],
    budget: float,
    in_use: int,
    tier: str,
    kv: int,
) -> str | None:
    """Why ``kv`` more tokens of ``tier`` may not be reserved under the shares, or None.

    ``in_use`` is every tier's reservations together; the budget itself (and the owed-KV
    rule) is checked by the caller (``extproc.policy.kv.kv_fits``)."""
    if not shares:
        return None
    mine = held.get(tier, 0)
    if kv > burst_room(shares.get(tier), mine, budget):
        return f"tier {tier!r} is at its KV burst cap"
    reserved = reserved_for_others(shares, held, active, budget, tier)
    if reserved and in_use + kv + reserved > budget:
        return f"{reserved:.0f} KV tokens are guaranteed to other tiers"
    return None
