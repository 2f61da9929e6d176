"""Keeps a pool's placement index (``extproc.policy.placement_index``) current with its endpoints.

The index holds each endpoint's candidate; placement reads it instead of building and
scoring a candidate for every endpoint on every request. An endpoint's entry is renewed
when something it is built from changes, and only then:

* one of its counts or settings is set (``EndpointState.__setattr__`` calls the hook
  ``watch`` gave it): the counts alone (``COUNTS``: reservations, leases) rebuild the
  candidate from the standing already read; a setting (``STANDING``) reads it again;
* its breaker or watermark calls ``on_change`` (a transition, a ramp step, a sample);
* time passes the point up to which its standing holds (``Standing.through``, from the
  breaker's and the watermark's ``next_change``: a cooldown or override ending, a ramp
  step ending, metrics going stale; a scale still ramping up holds only for the instant
  it was read, so such an endpoint is read again at every pick).

Renewal is lazy: ``fresh`` applies what changed before each read. Time never goes back
here, as in the breakers and watermarks, which clamp it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from extproc.policy.placement import Candidate
from extproc.policy.placement_index import PlacementIndex

__all__ = ["COUNTS", "STANDING", "EndpointIndex", "Standing", "through"]

COUNTS = frozenset(
    {"kv_in_use", "in_flight", "leased_slots", "leased_kv", "others_slots", "others_kv"}
)
STANDING = frozenset({"spec", "ip", "draining", "overcommit", "wm", "breaker"})
_UNSET = object()


class Standing(NamedTuple):
    """What an endpoint's breaker, metrics and settings say at one time."""

    usable: bool
    kv_scale: float
    waiting: float
    through: float  # it holds up to this time, unless a sample, an outcome or a setting comes first


def through(change: float, now: float) -> float:
    """The last time a reading at ``now`` holds, given the next change: a little before it,
    since the breaker and the watermark compare times after arithmetic."""
    if change == math.inf:
        return change
    return now if change <= now else max(now, change - 1e-9 * max(1.0, abs(change)))


class Watched(Protocol):
    """What the index reads of an endpoint (``extproc.backends.endpoints.EndpointState``)."""

    @property
    def key(self) -> str: ...

    def watch(self, hook: Callable[[str], None] | None) -> None: ...

    def standing(self, now: float) -> Standing: ...

    def counted(self, s: Standing) -> tuple[Candidate, int | None]: ...


class EndpointIndex:
    def __init__(self) -> None:
        self.index = PlacementIndex()
        self._stale: dict[str, bool] = {}  # key -> renew its entry (True: its standing too)
        self._standing: dict[str, Standing] = {}
        self._expiry: list[tuple[float, str]] = []  # (time a standing holds through, key): a heap
        self._now = -math.inf
        self._largest: int | None | object = _UNSET

    def watch(self, st: Watched) -> None:
        key = st.key

        def changed(what: str) -> None:
            self._stale[key] = self._stale.get(key, False) or what not in COUNTS
            if what in ("spec", "draining"):
                self._largest = _UNSET

        st.watch(changed)

    def forget(self, st: Watched) -> None:
        st.watch(None)
        self.index.remove(st.key)
        self._standing.pop(st.key, None)
        self._stale.pop(st.key, None)
        self._largest = _UNSET

    def fresh(self, by_key: Mapping[str, Watched], now: float) -> PlacementIndex:
        """The index, every entry renewed that changed or whose standing ``now`` has passed."""
        now = self._now = max(now, self._now)
        heap, stale, standing = self._expiry, self._stale, self._standing
        while heap and heap[0][0] < now:
            t, key = heapq.heappop(heap)
            s = standing.get(key)
            if s is not None and s.through == t:
                stale[key] = True
        for key, whole in list(stale.items()):
            st = by_key.get(key)
            if st is None:
                self.index.remove(key)
                standing.pop(key, None)
            else:
                s = standing.get(key)
                if whole or s is None:
                    s = standing[key] = st.standing(now)
                    if s.through < math.inf:
                        heapq.heappush(heap, (s.through, key))
                self.index.put(*st.counted(s))
            del stale[key]  # a transition due at ``now`` that reading it set off is read already
        return self.index

    def largest_capacity(self, compute: Callable[[], int | None]) -> int | None:
        """``compute()``, kept until an endpoint joins, leaves, changes or drains."""
        if self._largest is _UNSET:
            self._largest = compute()
        return self._largest  # type: ignore[return-value]
