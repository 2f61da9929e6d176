"""A bounded, weighted-fair admission queue: requests wait for a slot instead of a 429.

The queue only orders and bounds; the async adapter parks a waiter per item, calls
``next_eligible`` when capacity frees up, ``expire`` on a tick (expired items get a
503), and ``remove`` when a waiting client disconnects.

Algorithm: start-time fair queuing over tiers with unit cost per request. Each
backlogged tier carries a virtual start tag for its head item; ``next_eligible``
admits the head of the tier with the smallest tag (ties: higher ``priority``, then
configuration order) and advances that tier's tag by ``1 / weight``. The queue's
virtual time ``V`` is the tag of the last admission. A tier that becomes backlogged
starts at ``max(V, its last tag)``: idle time earns no credit, so a returning tier
cannot burst, and a tier that has just been served waits its turn. Under sustained
backlog each tier therefore gets ``weight / sum(weights)`` of admissions, exactly up
to one item per tier, whatever the others' arrival rates: a flood of premium
requests cannot starve free ones (strict priority does; see
gateway-api-inference-extension #1861). Within a tier the order is FIFO.

Skipped tiers: ``can_admit(tier)`` lets the caller veto a tier (no slot it may use).
A vetoed tier keeps its place: its tag is lifted to ``V`` at most, so when it can
admit again its head goes next. Like an idle tier, it banks no credit for the time
it could not use capacity, so it cannot starve the others afterwards.

Look-ahead: a caller may let a vetoed tier admit one of the few items behind its
head instead (``behind``), when the head is blocked by something the items behind
it do not need (a pool where the head fits no endpoint; the caller keeps the room
it is owed). FIFO otherwise.

Deadlines: ``next_eligible`` may admit an item whose ``max_wait_s`` passed since the
last ``expire`` call (a slot free now beats a 503); call ``expire(now)`` first for
strict deadlines. Every enqueued item leaves exactly once: admitted, removed or
expired.

Pure: no I/O, no clock (``now`` is monotonic seconds, passed in), no threads.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from extproc.policy.reasons import Reason

__all__ = [
    "AdmissionQueue",
    "Enqueued",
    "Rejected",
    "TierQueueConfig",
]

K = TypeVar("K", bound=Hashable)
_RATE_SAMPLES = 32


@dataclass(frozen=True)
class TierQueueConfig:
    max_depth: int
    max_wait_s: float
    weight: float = 1.0
    priority: int = 0  # breaks ties in virtual time; higher goes first

    def __post_init__(self) -> None:
        if self.max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        if not self.weight > 0:
            raise ValueError("weight must be > 0")


@dataclass(frozen=True)
class Enqueued(Generic[K]):
    item_id: K
    tier: str
    position: int  # 1-based place in the tier's line
    deadline: float  # when ``expire`` gives it up


@dataclass(frozen=True)
class Rejected(Generic[K]):
    item_id: K
    tier: str
    reason: Reason
    retry_after_s: float


class _Tier(Generic[K]):
    __slots__ = ("cfg", "items", "order", "tag", "recent", "counts")

    def __init__(self, cfg: TierQueueConfig, order: int) -> None:
        self.cfg = cfg
        self.order = order
        self.items: OrderedDict[K, float] = OrderedDict()  # item -> enqueued at
        self.tag = 0.0  # virtual start of the head item (or last finish, when empty)
        self.recent: deque[float] = deque(maxlen=_RATE_SAMPLES)  # admission times
        self.counts = dict.fromkeys(("enqueued", "admitted", "expired", "removed", "rejected"), 0)


class AdmissionQueue(Generic[K]):
    """Callers serialise access (one event loop, or a lock)."""

    def __init__(
        self, tiers: Mapping[str, TierQueueConfig], max_total_depth: int | None = None
    ) -> None:
        if not tiers:
            raise ValueError("at least one tier is required")
        if max_total_depth is not None and max_total_depth < 0:
            raise ValueError("max_total_depth must be >= 0")
        self._tiers: dict[str, _Tier[K]] = {
            name: _Tier(cfg, i) for i, (name, cfg) in enumerate(tiers.items())
        }
        self._max_total = max_total_depth
        self._where: dict[K, str] = {}  # queued item -> its tier
        self._vtime = 0.0
        self._now = float("-inf")

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._where

    def _clock(self, now: float) -> float:
        self._now = max(self._now, now)
        return self._now

    def _tier(self, tier: str) -> _Tier[K]:
        try:
            return self._tiers[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}") from None

    def enqueue(self, item_id: K, tier: str, now: float) -> Enqueued[K] | Rejected[K]:
        now = self._clock(now)
        t = self._tier(tier)
        if item_id in self._where:
            raise ValueError(f"item {item_id!r} is already queued")
        full = self._max_total is not None and len(self._where) >= self._max_total
        if full or len(t.items) >= t.cfg.max_depth:
            t.counts["rejected"] += 1
            return Rejected(item_id, tier, Reason.QUEUE_FULL, self.retry_after_hint(tier, now))
        if not t.items:
            t.tag = max(t.tag, self._vtime)  # idle time earns no credit
        t.items[item_id] = now
        t.counts["enqueued"] += 1
        self._where[item_id] = tier
        return Enqueued(item_id, tier, len(t.items), now + t.cfg.max_wait_s)

    def remove(self, item_id: K) -> bool:
        """Take out a waiting item (its client left); False if it was not queued."""
        tier = self._where.pop(item_id, None)
        if tier is None:
            return False
        t = self._tiers[tier]
        del t.items[item_id]
        t.counts["removed"] += 1
        return True

    def expire(self, now: float) -> list[K]:
        """Remove and return the items whose deadline has come, earliest first."""
        now = self._clock(now)
        gone: list[tuple[float, K]] = []
        for t in self._tiers.values():
            while t.items:
                item_id, since = next(iter(t.items.items()))
                deadline = since + t.cfg.max_wait_s
                if now < deadline:
                    break
                t.items.popitem(last=False)
                del self._where[item_id]
                t.counts["expired"] += 1
                gone.append((deadline, item_id))
        gone.sort(key=lambda pair: pair[0])
        return [item_id for _, item_id in gone]

    def next_eligible(self, can_admit: Callable[[str], bool], now: float,
                      behind: Callable[[str, list[K]], K | None] | None = None,
                      look_ahead: int = 0) -> K | None:
        """Dequeue the next item to admit, or None if no queued tier may admit now.

        ``can_admit`` is asked about backlogged tiers in fair order, stopping at the
        first yes. When it says no and ``behind`` is given, ``behind(tier, items)`` may
        name one of the up to ``look_ahead`` items after the tier's head to admit
        instead (the caller keeps the head's claim); the tier's turn is used as if the
        head had gone.
        """
        now = self._clock(now)
        line = sorted(
            (t.tag, -t.cfg.priority, t.order, name) for name, t in self._tiers.items() if t.items
        )
        skipped: list[_Tier[K]] = []
        chosen: K | None = None
        for *_, name in line:
            t = self._tiers[name]
            if can_admit(name):
                break
            if behind is not None and look_ahead > 0 and len(t.items) > 1:
                it = iter(t.items)
                next(it)
                chosen = behind(name, [k for _, k in zip(range(look_ahead), it, strict=False)])
                if chosen is not None and chosen in t.items:
                    break
                chosen = None
            skipped.append(t)
        else:
            return None
        if chosen is None:
            item_id, _ = t.items.popitem(last=False)
        else:
            item_id = chosen
            del t.items[item_id]
        del self._where[item_id]
        self._vtime = max(self._vtime, t.tag)
        t.tag += 1.0 / t.cfg.weight
        t.counts["admitted"] += 1
        t.recent.append(now)
        for s in skipped:  # keep their place, bank no credit
            s.tag = max(s.tag, self._vtime)
        return item_id

    def head(self, tier: str) -> K | None:
        """The next item of ``tier`` in FIFO order, or None if its line is empty."""
        t = self._tiers.get(tier)
        return next(iter(t.items), None) if t is not None else None

    def depth(self, tier: str | None = None) -> int:
        return len(self._where) if tier is None else len(self._tier(tier).items)

    def oldest_wait(self, now: float, tier: str | None = None) -> float:
        """How long the longest-waiting item (of ``tier``, or of any) has waited; 0 if none."""
        tiers = self._tiers.values() if tier is None else [self._tier(tier)]
        heads = [next(iter(t.items.values())) for t in tiers if t.items]
        return max(0.0, now - min(heads)) if heads else 0.0

    def retry_after_hint(self, tier: str, now: float) -> float:
        """Rough seconds until the tier's line has drained, for ``Retry-After``.

        From the tier's recent admission rate (the last admissions, counted up to
        ``now`` so that a stalled tier looks slow); without history, the tier's
        ``max_wait_s``. Never more than ``max(max_wait_s, 1)``; callers round up.
        """
        t = self._tier(tier)
        cap = max(t.cfg.max_wait_s, 1.0)
        span = now - t.recent[0] if t.recent else 0.0
        if span <= 0:
            return cap
        rate = len(t.recent) / span
        return min(cap, max(1, len(t.items)) / rate)

    def snapshot(self) -> dict[str, Any]:
        return {
            "depth": len(self._where),
            "max_total_depth": self._max_total,
            "virtual_time": self._vtime,
            "tiers": {
                name: {
                    "depth": len(t.items),
                    "max_depth": t.cfg.max_depth,
                    "max_wait_s": t.cfg.max_wait_s,
                    "weight": t.cfg.weight,
                    "priority": t.cfg.priority,
                    "oldest_enqueued_at": next(iter(t.items.values())) if t.items else None,
                    **t.counts,
                }
                for name, t in self._tiers.items()
            },
        }
