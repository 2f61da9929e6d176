"""Fair share by work among the tenants of one tier: virtual token counters (VTC). Pure.

Counting requests gives a tenant sending 16k-token prompts the same turn as one sending
200-token chats; counting work does not. As in VTC (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024, arXiv 2401.00588) and llm-d's flow control, a request's
work is its input tokens plus twice its output tokens (decoding a token costs about twice
prefilling one), and each tenant's counter adds up the work it was given:

* the counter is charged at admission with the request's expected work (prompt + 2 x its
  reservation) and corrected at settle with what it really used, so a tenant is never
  credited for work it was promised but did not use;
* the next request of a tier goes to its backlogged tenant with the smallest counter
  (ties: the smaller request, then the one that waited longest);
* a tenant that becomes backlogged is lifted to the smallest counter among those already
  backlogged (to the last one served when none is): idle time earns no credit, so a
  tenant returning after a pause cannot take the tier over.

Between two tenants backlogged together the counters then differ by at most about one
request's work (VTC's bound); ``difference`` reports it, and ``jain`` Jain's fairness
index of the recent (decayed) service of the backlogged tenants: 1.0 when they were
served equally, 1/n when one took everything.

Order alone is not enough when one tenant fills the cache: a light tenant's request is
first in line but still waits for a heavy one's requests to end before anything is free
(and those, admitted together, end together: seconds apart). So a request leaves free,
for each other active tenant of its tier that was given less work, the room that tenant
recently needed and does not hold (``peer_headroom``: its decayed peak of KV reserved
plus waiting, up to its fair share of the budget, less what it holds), at most
``PEER_HEADROOM_CAP`` of the budget in all (``extproc.policy.kv``). Max-min fairness: a
tenant asking for less than its share gets what it asks for at once; a heavy tenant gives
up only what the light ones have recently used. For the same reason, when the tenant the
counters pick is over its fair share of the cache and its request does not fit, a request
of a tenant under its share that fits may go first (``under_share``; the caller's
look-ahead, ``extproc.backends.queue``): a blocked heavy request does not hold a light
tenant's turn.

Pure: ``now`` is passed in; the caller serialises access.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEMAND_HALF_LIFE_S",
    "OUTPUT_WEIGHT",
    "PEER_HEADROOM_CAP",
    "RECENT_HALF_LIFE_S",
    "Demand",
    "TenantLedger",
    "jain_index",
    "peer_headroom",
    "under_share",
    "work",
]

OUTPUT_WEIGHT = 2.0
# At most this fraction of the KV budget is kept free for a tier's less-served tenants.
PEER_HEADROOM_CAP = 0.5
# A tenant's peak demand (KV reserved + waiting) decays with this half-life once it asks for less,
# and the room kept for it is this many times the peak: arrivals come in bursts, and a burst a
# little larger than the last must not wait for a heavy tenant's requests to end.
DEMAND_HALF_LIFE_S = 60.0
PEAK_MARGIN = 1.5
# Jain's index looks at service decayed with this half-life: long enough to span many
# requests, short enough that an hour-old burst does not count against a tenant now.
RECENT_HALF_LIFE_S = 30.0


def work(input_tokens: int, output_tokens: int) -> float:
    """What a request costs in the fair share: input plus twice the output tokens."""
    return float(max(0, input_tokens)) + OUTPUT_WEIGHT * max(0, output_tokens)


def jain_index(xs: Iterable[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2); 1.0 for an empty or all-zero set."""
    vals = [max(0.0, x) for x in xs]
    sq = sum(x * x for x in vals)
    if not vals or sq == 0:
        return 1.0
    return sum(vals) ** 2 / (len(vals) * sq)


@dataclass(slots=True)
class _Recent:
    value: float = 0.0
    at: float = 0.0

    def add(self, amount: float, now: float) -> None:
        self.value = self.read(now) + amount
        self.at = max(self.at, now)

    def read(self, now: float) -> float:
        dt = max(0.0, now - self.at)
        return self.value * math.pow(0.5, dt / RECENT_HALF_LIFE_S)


@dataclass(slots=True)
class Demand:
    """One tenant's KV demand in a tier: what it holds, what waits, and its decayed peak of both."""

    held: int = 0
    waiting: int = 0
    peak: float = 0.0
    at: float = 0.0  # when the peak was last updated (and the tenant last seen)

    def note(self, now: float) -> None:
        """Fold the demand now into the decayed peak."""
        self.peak = max(float(self.held + self.waiting), self.peak_at(now))
        self.at = max(self.at, now)

    def peak_at(self, now: float) -> float:
        return self.peak * math.pow(0.5, max(0.0, now - self.at) / DEMAND_HALF_LIFE_S)


def _seen(demand: Mapping[str, Demand], now: float, hold_s: float) -> list[str]:
    return [t for t, d in demand.items() if now - d.at < hold_s or d.held or d.waiting]


def under_share(
    demand: Mapping[str, Demand], tenant: str, budget: float, now: float, hold_s: float
) -> bool:
    """Whether ``tenant`` holds less than a fair share of ``budget`` among its tier's tenants seen
    within ``hold_s`` (one seen alone holds its share: the whole budget)."""
    d = demand.get(tenant)
    seen = _seen(demand, now, hold_s)
    return d is None or d.held < budget / max(1, len(seen))


def peer_headroom(
    ledger: TenantLedger,
    tenant: str,
    demand: Mapping[str, Demand],
    budget: float,
    now: float,
    hold_s: float,
) -> int:
    """The KV a request of ``tenant`` leaves free: for each other tenant of its tier that was
    given less work and was seen within ``hold_s``, its decayed peak demand up to a fair share
    of ``budget`` (among those seen), less what it holds."""
    if len(demand) < 2:
        return 0
    seen = _seen(demand, now, hold_s)
    if len(seen) < 2:
        return 0
    fair = budget / len(seen)
    mine = ledger.counter(tenant)
    out = 0.0
    for t in seen:
        if t != tenant and ledger.counter(t) < mine:
            d = demand[t]
            out += max(0.0, min(PEAK_MARGIN * d.peak_at(now), fair) - d.held)
    return int(out)


class TenantLedger:
    """The virtual counters of one tier's tenants."""

    __slots__ = ("_counter", "_recent", "_last")

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._recent: dict[str, _Recent] = {}
        self._last: str | None = None  # the tenant charged last

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def lift(self, tenant: str, backlogged: Collection[str]) -> None:
        """``tenant`` becomes backlogged: no credit for the time it was idle."""
        others = [self._counter.get(t, 0.0) for t in backlogged if t != tenant]
        if others:
            floor = min(others)
        elif self._last is not None and self._last != tenant:
            floor = self._counter.get(self._last, 0.0)
        else:
            return
        if self._counter.get(tenant, 0.0) < floor:
            self._counter[tenant] = floor

    def charge(self, tenant: str, amount: float, now: float) -> None:
        """Add ``amount`` of work to ``tenant`` (negative: a correction at settle)."""
        c = self._counter.get(tenant, 0.0) + amount
        self._counter[tenant] = max(0.0, c)
        r = self._recent.get(tenant)
        if r is None:
            r = self._recent[tenant] = _Recent(0.0, now)
        r.add(amount, now)
        if amount > 0:
            self._last = tenant

    def pick(self, heads: Iterable[tuple[str, float, float]]) -> str | None:
        """Of ``(tenant, head work, head enqueued at)``, the tenant whose head goes next."""
        best: tuple[float, float, float, str] | None = None
        for tenant, w, at in heads:
            key = (self._counter.get(tenant, 0.0), w, at, tenant)
            if best is None or key < best:
                best = key
        return None if best is None else best[3]

    def leads(
        self, tenant: str, amount: float, backlogged: Collection[str], heads: dict[str, float]
    ) -> bool:
        """Whether a request of ``amount`` from ``tenant`` (not backlogged) would be picked before
        every backlogged tenant's head (``heads``: tenant -> head work), after its lift."""
        if not backlogged:
            return True
        mine = max(
            self._counter.get(tenant, 0.0), min(self._counter.get(t, 0.0) for t in backlogged)
        )
        return all(
            (mine, amount) < (self._counter.get(t, 0.0), heads.get(t, 0.0)) for t in backlogged
        )

    def difference(self, backlogged: Collection[str]) -> float:
        """The largest gap between the counters of tenants backlogged together (0 for fewer
        than two)."""
        if len(backlogged) < 2:
            return 0.0
        vals = [self._counter.get(t, 0.0) for t in backlogged]
        return max(vals) - min(vals)

    def jain(self, tenants: Collection[str], now: float) -> float:
        if len(tenants) < 2:
            return 1.0
        return jain_index(self._recent[t].read(now) if t in self._recent else 0.0 for t in tenants)

    def forget(self, keep: Collection[str]) -> None:
        """Drop the counters of tenants no longer in the policy."""
        for t in [t for t in self._counter if t not in keep]:
            del self._counter[t]
            self._recent.pop(t, None)
        if self._last is not None and self._last not in keep:
            self._last = None

    def snapshot(self, now: float) -> dict[str, dict[str, float]]:
        return {
            t: {
                "counter": round(c, 1),
                "recent": round(self._recent[t].read(now), 1) if t in self._recent else 0.0,
            }
            for t, c in sorted(self._counter.items())
        }
