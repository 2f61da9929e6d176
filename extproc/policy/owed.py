"""Owed KV per endpoint: the room a blocked, more important waiter is kept in a pool. Pure.

On one backend the owed-KV rule (``extproc.policy.kv``) keeps free the room a more
important waiter needs. A pool's budget is the sum of its endpoints', and a request
must fit one endpoint: a premium request of 5k tokens can fit the pool's sum while
fitting no single endpoint, and small lower-tier requests keep landing on whichever
endpoint frees room first, so the room never accumulates anywhere and the premium
request (and every one of its tier behind it) waits until its deadline.

The rule: when the head of a tier above the requester's fits no endpoint now (the
most important such tier, as the owed-KV rule takes the most important waiter), one
endpoint is *owed* to it, and the requester is not placed there; the other endpoints
stay open to it. The owed endpoint is where the waiter would fit soonest:

* only usable endpoints (breaker not open, metrics fresh) whose whole cache holds the
  footprint (a lone request fits an empty endpoint, as in placement);
* fewest KV tokens that must be released there first: ``in_use + kv - budget`` while
  the footprint fits the endpoint's watermark-scaled budget, else all of ``in_use``
  (it waits for the endpoint to empty: the lone-request rule);
* then fewest slots that must be released, the larger cache, the key.

Since nothing of a lower tier lands on the owed endpoint, its reservations only
shrink and the waiter fits there once enough of them have finished. The choice is
recomputed from the state on every decision (no memory): it moves only to an
endpoint that needs less released (or as much, and earlier in the tie-break), so it
moves finitely often and the head is placed. Without any usable endpoint that can hold it, nothing is owed.

Look-ahead within a tier: the queue is FIFO within a tier, so every request of the
tier waits behind a head that fits nowhere. In a pool, up to ``LOOK_AHEAD`` requests
behind such a head may go first when they fit an endpoint *other than the one owed
to the head* (and the head's only block is placement: it fits the pool's budget, and
no slot is missing). The head keeps its owed endpoint against its own tier as against
lower ones, so it is placed as above; the requests behind it no longer wait for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from extproc.policy.placement import Candidate, fits

__all__ = ["LOOK_AHEAD", "blocked_head", "designate", "owed_endpoint", "owed_endpoints", "shortfall"]

# How many requests behind a tier's head that fits no endpoint the queue looks at for one
# that fits (extproc.policy.admission_queue ``behind``): bounded, so a pump stays cheap.
LOOK_AHEAD = 8


def shortfall(c: Candidate, kv: int) -> tuple[int, int] | None:
    """(KV tokens, slots) that must be released on ``c`` before ``kv`` fits; None if never."""
    if not c.usable:
        return None
    slots = max(0, c.in_flight - c.max_concurrency + 1)
    if c.kv_capacity is None:
        return 0, slots
    if kv > c.kv_capacity:
        return None
    budget = c.kv_capacity * c.kv_scale
    tokens = max(0, math.ceil(c.kv_in_use + kv - budget)) if kv <= budget else c.kv_in_use
    return min(tokens, c.kv_in_use), slots


def designate(candidates: Iterable[Candidate], kv: int) -> str | None:
    """The endpoint a footprint of ``kv`` would fit on soonest (see the module doc)."""
    best: tuple[int, int, float, str] | None = None
    for c in candidates:
        need = shortfall(c, kv)
        if need is None:
            continue
        key = (need[0], need[1], -float("inf") if c.kv_capacity is None else -c.kv_capacity, c.key)
        if best is None or key < best:
            best = key
    return None if best is None else best[3]


def blocked_head(candidates: Sequence[Candidate], heads: Mapping[str, int],
                 priorities: Mapping[str, int], tier: str) -> int | None:
    """The footprint of the head of the most important tier above ``tier`` whose head fits
    no endpoint now (``heads``: each waiting tier's head footprint)."""
    mine = priorities.get(tier, 0)
    above = sorted((t for t in heads if priorities.get(t, 0) > mine), key=lambda t: -priorities.get(t, 0))
    for t in above:
        kv = heads[t]
        if not any(fits(c, kv) for c in candidates):
            return kv
    return None


def owed_endpoint(candidates: Sequence[Candidate], heads: Mapping[str, int],
                  priorities: Mapping[str, int], tier: str) -> str | None:
    """The endpoint a request of ``tier`` may not be placed on, or None."""
    if not heads:
        return None
    kv = blocked_head(candidates, heads, priorities, tier)
    return None if kv is None else designate(candidates, kv)


def owed_endpoints(candidates: Sequence[Candidate], heads: Mapping[str, int],
                   priorities: Mapping[str, int], tier: str, behind_head: bool = False) -> tuple[str, ...]:
    """Every endpoint a request of ``tier`` may not be placed on: the one owed above it, and,
    for a request admitted past its own tier's blocked head (``behind_head``), the head's."""
    out: list[str] = []
    above = owed_endpoint(candidates, heads, priorities, tier)
    if above is not None:
        out.append(above)
    if behind_head:
        kv = heads.get(tier)
        if kv is not None and not any(fits(c, kv) for c in candidates):
            mine = designate(candidates, kv)
            if mine is not None and mine not in out:
                out.append(mine)
    return tuple(out)
