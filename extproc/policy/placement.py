"""Where an admitted request goes in a pool: the endpoint picking score. Pure.

Admission (the pool's slot pool and KV budget) decides *whether*; this decides
*where*. An endpoint is a candidate only if it is usable (breaker not open, metrics
neither unreachable nor stale: silence counts as full), has a free slot of its own,
and the request's KV footprint fits in its budget (``kv_capacity_tokens`` scaled by
that endpoint's watermark), leaving the other active tiers' unused KV guarantees there
free and within the tier's burst cap there (``extproc.policy.kv_shares``). A lone request
fits an empty endpoint whose whole cache
holds it, as on a single backend, so a large prompt cannot starve while the scale is
low. Among candidates the score, lowest first, is:

1. the fraction of the endpoint's KV budget still free *after* placing the request,
   negated (most headroom wins: long prompts land where they fit best, and endpoints
   of different sizes fill in proportion);
2. the engine's waiting queue (a queueing engine is past its batch capacity);
3. Sluice's requests in flight there, as a fraction of the endpoint's slots;
4. the endpoint's key, so the choice is deterministic.

No candidate: ``None``, and the request waits in the pool's queue as it does when the
pool's own budget is spent. An endpoint owed to a blocked, more important waiter
(``extproc.policy.owed``) is not a candidate for the requests it is owed against.

Prefix affinity (``preferred``): the endpoint that last served the request's prompt
prefix, whose engine likely holds it in its prefix cache, is chosen over the score
while it is a candidate (usable, a free slot, the footprint fits its budget) *and*
the fraction of its budget free after placing the request is at least
``min_headroom``. Past that it is treated as full for affinity's sake and the score
decides: a popular prefix spills to other endpoints instead of piling onto one until
it preempts. The footprint is not discounted for the cached prefix: the engine may
evict those blocks before the request runs, and then it needs them all.

Second choice (``second_choice``): where Envoy retries once if the picked endpoint
refuses the connection. The best candidate by the score (never by affinity) other than
the primary and the excluded (owed) endpoints, judged as the pool stands *after* the
primary's reservation; nothing is reserved on it, since it is used only if the primary
fails to connect. The primary's reservation changes only the primary, which is excluded,
so the candidates the primary was picked from serve unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    key: str  # "host:port"
    usable: bool
    kv_in_use: int  # Sluice's reservations on this endpoint
    kv_capacity: int | None  # None: no KV bound, only slots
    kv_scale: float  # the endpoint's watermark scale in (0, 1]
    in_flight: int
    max_concurrency: int
    waiting: float = 0.0  # the engine's own queue, 0 when it does not export one
    # KV shares (extproc.policy.kv_shares) for the tier being placed: the other active tiers'
    # unused guarantees on this endpoint, and how much more the tier may hold here (burst cap).
    kv_reserved: float = 0.0
    kv_burst_room: float = float("inf")


@dataclass(frozen=True, slots=True)
class Placement:
    key: str
    score: tuple[float, float, float, str]
    preferred: bool = False  # chosen by prefix affinity, not by the score
    affinity: str | None = None  # set by the caller that keeps the map: hit | spill | miss
    second: str | None = None  # where Envoy retries on a connect failure (second_choice); not reserved


def fits(c: Candidate, kv: int) -> bool:
    """Whether ``kv`` more tokens and one more request fit on ``c``."""
    if not c.usable or c.in_flight >= c.max_concurrency:
        return False
    if c.kv_capacity is None:
        return True
    if kv > c.kv_burst_room:
        return False
    if c.kv_in_use + kv + c.kv_reserved <= c.kv_capacity * c.kv_scale:
        return True
    return c.kv_in_use == 0 and kv + c.kv_reserved <= c.kv_capacity


def headroom(c: Candidate, kv: int) -> float:
    """The fraction of ``c``'s KV budget free after placing ``kv`` there (the score's first key)."""
    if c.kv_capacity is None:
        return 1.0
    budget = max(c.kv_capacity * c.kv_scale, 1.0)
    return (budget - c.kv_in_use - kv) / budget


def score(c: Candidate, kv: int) -> tuple[float, float, float, str]:
    return (-headroom(c, kv), max(c.waiting, 0.0), c.in_flight / max(c.max_concurrency, 1), c.key)


def pick(candidates: Iterable[Candidate], kv: int, preferred: str | None = None,
         min_headroom: float = 0.0, exclude: Collection[str] = ()) -> Placement | None:
    """The best endpoint for a request of KV footprint ``kv``, or None if it fits nowhere;
    ``preferred`` wins while it fits with ``min_headroom`` left (prefix affinity);
    ``exclude`` is never chosen (endpoints owed to blocked waiters,
    ``extproc.policy.owed``)."""
    best: Placement | None = None
    for c in candidates:
        if c.key in exclude or not fits(c, kv):
            continue
        s = score(c, kv)
        if c.key == preferred and -s[0] >= min_headroom:
            return Placement(c.key, s, preferred=True)
        if best is None or s < best.score:
            best = Placement(c.key, s)
    return best


def second_choice(candidates: Iterable[Candidate], kv: int, primary: str,
                  exclude: Collection[str] = ()) -> str | None:
    """The endpoint a request placed on ``primary`` falls back to if ``primary`` refuses the
    connection: the best by the score among the others where ``kv`` fits, not ``exclude``d;
    None when there is none (Envoy is then told not to retry)."""
    got = pick(candidates, kv, exclude={primary, *exclude})
    return None if got is None else got.key


def largest_capacity(candidates: Iterable[Candidate]) -> int | None:
    """The biggest single cache in the pool: a footprint above it fits nowhere, ever."""
    caps = [c.kv_capacity for c in candidates]
    if not caps or any(cap is None for cap in caps):
        return None
    return max(cap for cap in caps if cap is not None)
