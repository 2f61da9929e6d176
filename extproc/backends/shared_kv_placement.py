"""Placement on a pool whose tiers have KV shares: a scan of candidates for the tier placed.

A pool places through its index (``extproc.backends.endpoint_index``), which keeps each
endpoint's candidate as it stands for every request. With KV shares
(``extproc.policy.kv_shares``) a candidate depends on the tier being placed as well: the
other active tiers' unused guarantees on the endpoint are not its to take, and its own
burst cap there bounds it. One cached candidate per endpoint cannot hold an answer per
tier, so while some tier has a share the pool scores every endpoint per request, as
placement did before the index, with the tier's reservations and cap in each candidate.
Without shares (the common case, and what the scale benchmark measures) the index
answers; the two pick alike when no share is set (tests/test_shared_kv_placement.py).
Keeping the index for shares would take an index per tier renewed whenever any tier's
demand or reservations change: more bookkeeping than the scan saves on pools of a few
replicas, where KV shares matter most.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Protocol

from extproc.policy.kv_shares import KvShare, burst_room, reserved_for_others
from extproc.policy.placement import Candidate, Placement, pick, second_choice
from extproc.policy.schema import Endpoint

__all__ = ["Shares", "Shared", "count", "shared_candidates", "shared_pick"]

# The tier being placed, every tier's KV share, and which tiers are active
# (BackendState.shares_for).
Shares = tuple[str, Mapping[str, KvShare], Mapping[str, bool]]


class Shared(Protocol):
    """What the scan reads of an endpoint (``extproc.backends.endpoints.EndpointState``)."""

    spec: Endpoint
    leased_slots: int | None
    leased_kv: int
    kv_by_tier: Counter[str]

    def candidate(self, now: float, kv: int = 0) -> Candidate: ...


def with_shares(st: Shared, c: Candidate, shares: Shares) -> Candidate:
    """``c`` for the tier of ``shares``, judged on the endpoint's budget (its lease when leased)."""
    cap = st.spec.kv_capacity_tokens
    if cap is None:
        return c
    tier, table, active = shares
    budget = cap * c.kv_scale
    if st.leased_slots is not None:
        budget = min(budget, float(st.leased_kv))
    return replace(
        c,
        kv_reserved=reserved_for_others(table, st.kv_by_tier, active, budget, tier),
        kv_burst_room=burst_room(table.get(tier), st.kv_by_tier.get(tier, 0), budget),
    )


def shared_candidates(states: Iterable[Shared], now: float, kv: int, shares: Shares) -> list[Candidate]:
    return [with_shares(st, st.candidate(now, kv), shares) for st in states]


def shared_pick(
    states: Iterable[Shared],
    kv: int,
    now: float,
    shares: Shares,
    preferred: str | None = None,
    min_headroom: float = 0.0,
    exclude: Collection[str] = (),
) -> tuple[Placement | None, str | None]:
    """What ``PlacementIndex.pick`` answers, for the tier of ``shares``: (pick, second)."""
    cands = shared_candidates(states, now, kv, shares)
    got = pick(cands, kv, preferred, min_headroom, exclude)
    if got is None:
        return None, None
    return got, second_choice(cands, kv, got.key, exclude) if len(cands) > 1 else None


def count(per_tier: Counter[str], tier: str, kv: int) -> None:
    """Add ``kv`` (negative: take it) to what ``tier`` holds on an endpoint; none held, no key."""
    per_tier[tier] += kv
    if per_tier[tier] <= 0:
        del per_tier[tier]
