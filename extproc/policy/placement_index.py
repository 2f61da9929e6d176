"""A pool's candidates kept in score order: a pick costs per budget group, not per endpoint. Pure.

``extproc.policy.placement.pick`` scores every candidate of the pool for every request;
with hundreds of endpoints that is most of admission's cost, and nearly all of it repeats
the previous request's work (one placement or release moves one endpoint). The index
holds each endpoint's candidate, as it stands for a footprint of 0, updated by the caller
when the endpoint changes (``put``), and answers ``pick``'s, ``second_choice``'s and
"does it fit anywhere" for any footprint, choosing exactly what they choose.

Why that is possible: endpoints with the same KV capacity and scale have the same budget
B, and among them the score's first key, ``-(B - in_use - kv) / B``, orders them by
``in_use`` whatever ``kv`` is (strictly, for budgets below 2**50 tokens); so within such a
*group* the score's order does not depend on the footprint, and the group is kept sorted
by its score for a footprint of 0. A group's best is the first candidate in that order
that fits; the budget check (``in_use + kv`` within the budget, or the lone-request rule)
only gets harder down the order, so the walk stops at the first one whose budget cannot
take ``kv``. The pick is the best of the groups' bests by the exact score (``score``).
A candidate that can take nothing (unusable, no free slot, its budget or lease already
spent) is in no group.

Cost: per group, a step for each candidate skipped (an excluded one, or a lease too short
for the footprint) and two scores. A pool of like endpoints at full scale is one group;
endpoints whose watermark scales differ are groups of their own, and under KV pressure
the cost tends back to a score per endpoint.

A leased endpoint (a shared store) takes a footprint only within this replica's lease:
its ``lease_room`` (lease minus this replica's reservations) bounds it too.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Collection
from dataclasses import dataclass, replace

from extproc.policy.placement import Candidate, Placement, fits, headroom, score

__all__ = ["PlacementIndex", "for_footprint"]

Order = tuple[float, float, float, str]  # score(c, 0): the order within a group
Group = tuple[int, float] | None  # (KV capacity, scale); None: no KV bound


def for_footprint(c: Candidate, lease_room: int | None, kv: int) -> Candidate:
    """``c`` as it stands for a footprint of ``kv``: unusable where the lease cannot hold it."""
    if lease_room is None or kv <= lease_room or not c.usable:
        return c
    return replace(c, usable=False)


def budget_room(c: Candidate) -> float:
    """The largest footprint ``c``'s budget takes (``placement.fits`` without the slot and
    usability checks): ``in_use + kv`` within the scaled budget, or, on an empty endpoint,
    its whole cache."""
    cap = c.kv_capacity
    if cap is None:
        return math.inf
    within = math.floor(cap * c.kv_scale) - c.kv_in_use  # an int within a float: within its floor
    return max(within, cap) if c.kv_in_use == 0 else within


def _by_score(p: Placement) -> tuple[float, float, float, str]:
    return p.score


@dataclass(slots=True)
class _Entry:
    cand: Candidate
    lease_room: int | None
    room: float  # budget_room(cand)
    group: Group
    order: Order | None  # its place in its group; None: it takes nothing, in no group


class PlacementIndex:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._groups: dict[Group, list[Order]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def groups(self) -> int:
        return len(self._groups)

    def put(self, c: Candidate, lease_room: int | None = None) -> None:
        """``c`` (for a footprint of 0) is how the endpoint ``c.key`` stands now."""
        self.remove(c.key)
        room = budget_room(c)
        e = _Entry(
            c,
            lease_room,
            room,
            None if c.kv_capacity is None else (c.kv_capacity, c.kv_scale),
            None,
        )
        if (
            c.usable
            and c.in_flight < c.max_concurrency
            and room >= 0
            and (lease_room is None or lease_room >= 0)
        ):
            e.order = score(c, 0)
            insort(self._groups.setdefault(e.group, []), e.order)
        self._entries[c.key] = e

    def remove(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is None or e.order is None:
            return
        members = self._groups[e.group]
        del members[bisect_left(members, e.order)]  # orders are unique: they end with the key
        if not members:
            del self._groups[e.group]

    def candidate(self, key: str, kv: int = 0) -> Candidate | None:
        e = self._entries.get(key)
        return None if e is None else for_footprint(e.cand, e.lease_room, kv)

    def best(self, kv: int, exclude: Collection[str] = (), n: int = 2) -> list[Placement]:
        """The ``n`` best by the score where ``kv`` fits, none in ``exclude``, best first."""
        top: list[Placement] = []  # the best so far, best first
        entries = self._entries
        for members in self._groups.values():
            # No one in a group has more headroom than its first: a group whose first has
            # less than the n-th best so far has nothing better.
            if len(top) == n and -headroom(entries[members[0][3]].cand, kv) > top[-1].score[0]:
                continue
            taken = 0
            for order in members:
                key = order[3]
                if key in exclude:
                    continue
                e = entries[key]
                if kv > e.room:
                    break  # and so for every one after it in the group
                c = for_footprint(e.cand, e.lease_room, kv)
                if not fits(c, kv):
                    continue
                s = score(c, kv)
                if len(top) == n and s >= top[-1].score:
                    break  # the rest of the group scores worse still
                insort(top, Placement(key, s), key=_by_score)
                del top[n:]
                taken += 1
                if taken == n:
                    break
        return top

    def fits(self, kv: int, exclude: Collection[str] = ()) -> bool:
        return bool(self.best(kv, exclude, 1))

    def pick(
        self,
        kv: int,
        preferred: str | None = None,
        min_headroom: float = 0.0,
        exclude: Collection[str] = (),
    ) -> tuple[Placement | None, str | None]:
        """``placement.pick`` and, for its choice, ``placement.second_choice``: (pick, second)."""
        top = self.best(kv, exclude, 2)
        if (
            preferred is not None
            and preferred not in exclude
            and (e := self._entries.get(preferred)) is not None
        ):
            c = for_footprint(e.cand, e.lease_room, kv)
            if fits(c, kv):
                s = score(c, kv)
                if -s[0] >= min_headroom:
                    second = next((p.key for p in top if p.key != preferred), None)
                    return Placement(preferred, s, preferred=True), second
        if not top:
            return None, None
        return top[0], top[1].key if len(top) > 1 else None
