"""A bounded, weighted-fair admission queue: requests wait for a slot instead of a 429.

The queue only orders and bounds; the async adapter parks a waiter per item, calls
``next_eligible`` when capacity frees up, ``expire`` on a tick (expired items get a
503), and ``remove`` when a waiting client disconnects.

Algorithm: start-time fair queuing over tiers with unit cost per request, and fair
share by work among the tenants of a tier (``extproc.policy.fair_share``). Each
backlogged tier carries a virtual start tag for its head item; ``next_eligible``
admits the head of the tier with the smallest tag (ties: higher ``priority``, then
configuration order) and advances that tier's tag by ``1 / weight``. The queue's
virtual time ``V`` is the tag of the last admission. A tier that becomes backlogged
starts at ``max(V, its last tag)``: idle time earns no credit, so a returning tier
cannot burst, and a tier that has just been served waits its turn. Under sustained
backlog each tier therefore gets ``weight / sum(weights)`` of admissions, exactly up
to one item per tier, whatever the others' arrival rates: a flood of premium
requests cannot starve free ones (strict priority does; see
gateway-api-inference-extension #1861). Within a tier the next item is the head of the
backlogged tenant that was given the least work (virtual token counters, charged by the
caller with ``charge``: a tenant sending 16k-token prompts does not get the same turn as
one sending 200-token chats); each tenant's own items are FIFO. An item enqueued without
a tenant is its own FIFO line under the tenant "".

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
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from extproc.policy.fair_share import Demand, TenantLedger, peer_headroom
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
    __slots__ = ("cfg", "items", "order", "tag", "recent", "counts", "lines", "meta", "ledger")

    def __init__(self, cfg: TierQueueConfig, order: int) -> None:
        self.cfg = cfg
        self.order = order
        self.items: OrderedDict[K, float] = OrderedDict()  # item -> enqueued at (arrival order)
        self.lines: dict[str, deque[K]] = {}  # tenant -> its items, FIFO (only backlogged tenants)
        self.meta: dict[K, tuple[str, float]] = {}  # item -> (tenant, work)
        self.ledger = TenantLedger()
        self.tag = 0.0  # virtual start of the head item (or last finish, when empty)
        self.recent: deque[float] = deque(maxlen=_RATE_SAMPLES)  # admission times
        self.counts = dict.fromkeys(("enqueued", "admitted", "expired", "removed", "rejected"), 0)

    def add(self, item_id: K, tenant: str, work: float, now: float) -> None:
        line = self.lines.get(tenant)
        if line is None:
            self.ledger.lift(tenant, self.lines)
            line = self.lines[tenant] = deque()
        line.append(item_id)
        self.items[item_id] = now
        self.meta[item_id] = (tenant, work)

    def drop(self, item_id: K) -> None:
        del self.items[item_id]
        tenant, _ = self.meta.pop(item_id)
        line = self.lines[tenant]
        if line[0] == item_id:
            line.popleft()
        else:
            line.remove(item_id)
        if not line:
            del self.lines[tenant]

    def others(self, first: K | None, n: int) -> list[K]:
        """Up to ``n`` items but ``first``: the other tenants' heads (in the counters' order),
        then the rest in arrival order (the queue's look-ahead looks at these)."""
        heads = sorted(
            (line[0] for line in self.lines.values() if line[0] != first),
            key=lambda k: (self.ledger.counter(self.meta[k][0]), self.meta[k][1], self.items[k]),
        )
        out = heads[:n]
        if len(out) < n:
            taken = {first, *out}
            out += [
                k
                for _, k in zip(
                    range(n - len(out)), (k for k in self.items if k not in taken), strict=False
                )
            ]
        return out

    def first(self) -> K | None:
        """The item fair share by work picks next: the head of the least-served tenant."""
        if not self.lines:
            return None
        if len(self.lines) == 1:
            return next(iter(self.lines.values()))[0]
        tenant = self.ledger.pick(
            (t, self.meta[line[0]][1], self.items[line[0]]) for t, line in self.lines.items()
        )
        assert tenant is not None
        return self.lines[tenant][0]


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

    def enqueue(self, item_id: K, tier: str, now: float, tenant: str = "", work: float = 0.0
                ) -> Enqueued[K] | Rejected[K]:
        """Queue ``item_id`` in ``tier``'s line; ``work`` (``fair_share.work``) orders it among
        the tier's tenants."""
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
        t.add(item_id, tenant, work, now)
        t.counts["enqueued"] += 1
        self._where[item_id] = tier
        return Enqueued(item_id, tier, len(t.items), now + t.cfg.max_wait_s)

    def remove(self, item_id: K) -> bool:
        """Take out a waiting item (its client left); False if it was not queued."""
        tier = self._where.pop(item_id, None)
        if tier is None:
            return False
        t = self._tiers[tier]
        t.drop(item_id)
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
                t.drop(item_id)
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
                chosen = behind(name, t.others(t.first(), look_ahead))
                if chosen is not None and chosen in t.items:
                    break
                chosen = None
            skipped.append(t)
        else:
            return None
        item_id = t.first() if chosen is None else chosen
        assert item_id is not None
        t.drop(item_id)
        del self._where[item_id]
        self._vtime = max(self._vtime, t.tag)
        t.tag += 1.0 / t.cfg.weight
        t.counts["admitted"] += 1
        t.recent.append(now)
        for s in skipped:  # keep their place, bank no credit
            s.tag = max(s.tag, self._vtime)
        return item_id

    def head(self, tier: str) -> K | None:
        """The next item of ``tier`` (the least-served tenant's first), or None if its line is
        empty."""
        t = self._tiers.get(tier)
        return t.first() if t is not None else None

    # -- fair share by work among a tier's tenants (extproc.policy.fair_share) ---------------
    def charge(self, tier: str, tenant: str, work: float, now: float) -> None:
        """``tenant`` was given ``work`` in ``tier`` (at admission, queued or not; a negative
        correction at settle)."""
        t = self._tiers.get(tier)
        if t is not None:
            t.ledger.charge(tenant, work, now)

    def leads(self, tier: str, tenant: str, work: float) -> bool:
        """Whether a newcomer of ``tenant`` with ``work`` would go before every waiting item of
        ``tier`` (its tenant has nothing queued and was given less): it need not wait behind
        them."""
        t = self._tiers.get(tier)
        if t is None or not t.lines:
            return True
        if tenant in t.lines:
            return False
        heads = {n: t.meta[line[0]][1] for n, line in t.lines.items()}
        return t.ledger.leads(tenant, work, t.lines, heads)

    def fairness(self, tier: str, now: float) -> tuple[float, float]:
        """(service difference, Jain's index) among ``tier``'s backlogged tenants."""
        t = self._tier(tier)
        return t.ledger.difference(t.lines), t.ledger.jain(t.lines, now)

    def forget_tenants(self, keep: Collection[str]) -> None:
        """Drop the counters of tenants gone from the policy (a queued tenant keeps its own)."""
        for t in self._tiers.values():
            t.ledger.forget({*keep, *t.lines})

    def keep_counters(self, old: AdmissionQueue[Any]) -> None:
        """Carry the fair-share counters over from the queue this one replaces (a reload)."""
        for name, t in self._tiers.items():
            prev = old._tiers.get(name)
            if prev is not None:
                t.ledger = prev.ledger

    def headroom(
        self,
        tier: str,
        tenant: str,
        demand: Mapping[str, Demand],
        budget: float,
        now: float,
        hold_s: float,
    ) -> int:
        """The KV a request of ``tenant`` leaves free for less-served tenants of ``tier``
        (``extproc.policy.fair_share.peer_headroom``)."""
        t = self._tiers.get(tier)
        return 0 if t is None else peer_headroom(t.ledger, tenant, demand, budget, now, hold_s)

    def backlogged(self, tier: str) -> int:
        """How many tenants of ``tier`` have items waiting."""
        return len(self._tier(tier).lines)

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
