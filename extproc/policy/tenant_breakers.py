"""Blame each backend failure on its tenant or on the backend; a breaker per blamed tenant.

One tenant whose requests make the backend fail (a prompt that crashes it, a broken
client) must not open the backend's breaker for every other tenant. So each failure
(``Outcome.FAILURE``: a 5xx, a timeout, a reset) of tenant T is blamed on exactly one:

- **the backend**, when at least ``min_failing_tenants`` tenants (T included) are
  *failing*; or when no other tenant is *succeeding* and Sluice's own probe of the
  backend (``probed``) failed within ``window_s``. The backend's breakers count it;
- otherwise **T alone**: T's own breaker counts it, and the backend's breakers get
  ``Outcome.TENANT_FAILURE``, which they ignore.

A tenant is failing or succeeding by its latest outcome on this backend within
``window_s`` (the breaker's window). With nobody to compare against (a lone tenant, or
a moment an attacker picks when nobody else is sending) the failure proves nothing
about the backend by itself: it is T's, and Sluice asks for a probe of its own
(``probe_wanted``, at most one per ``own_probe_after_s``; ``extproc.service.prober``
sends it). A failing probe counts as the backend's failure and makes the lone tenant's
failures the backend's for ``window_s``; a passing one leaves them T's. With probes off
(``own_probe_after_s`` 0) a lone tenant's failure is the backend's, as before
attribution. ``min_failing_tenants=1`` blames the backend for every failure
(attribution off). Successes count for both; client errors and cancellations
for neither (they only give back a half-open probe's place).

A tenant breaker is an ordinary ``Breaker`` with the backend's config, judging errors
only (latency is the backend's speed, not the tenant's fault). It is created on the
tenant's first blamed failure and dropped once it is not open and the tenant has had
no outcome for ``window_s``. At most ``max_tenants`` breakers exist and at most that
many tenants' latest outcomes are remembered (the least recent forgotten first), so a
flood of tenants cannot grow memory. When every breaker place is held by an open
breaker, a new tenant's failure is the backend's: that many tenants failing at once is.

Pure: no I/O, no clock (``now`` is monotonic seconds, passed in), no threads.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

from extproc.policy.breaker import (
    Breaker,
    BreakerConfig,
    BreakerEvent,
    BreakerState,
    BreakerVerdict,
)
from extproc.policy.breaker_outcome import Outcome

__all__ = ["TenantBreakers"]

_ALLOWED = BreakerVerdict(True, BreakerState.CLOSED)


class TenantBreakers:
    """The tenants of one backend. Callers serialise access (one event loop, or a lock)."""

    def __init__(self, config: BreakerConfig, min_failing_tenants: int, max_tenants: int, now: float = 0.0) -> None:
        if min_failing_tenants < 1:
            raise ValueError("min_failing_tenants must be >= 1")
        if max_tenants < 1:
            raise ValueError("max_tenant_breakers must be >= 1")
        self.config = config
        self.min_failing_tenants = min_failing_tenants
        self.max_tenants = max_tenants
        self._now = now
        self._latest: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # tenant -> (at, failed), oldest first
        self._failing = 0  # tenants in _latest whose latest outcome failed
        self._breakers: dict[str, Breaker] = {}
        # Sluice's own latest probe of the backend: (at, the backend failed)
        self._verdict: tuple[float, bool] | None = None
        self._wanted = False  # a lone failure waits for a probe
        self._events: deque[tuple[str, BreakerEvent]] = deque(maxlen=1000)  # of breakers since dropped

    # -- queries ------------------------------------------------------------------------
    def allow(self, tenant: str, now: float) -> BreakerVerdict:
        now = self._advance(now)
        b = self._breakers.get(tenant)
        return _ALLOWED if b is None else b.allow(now)

    def backend_to_blame(self, tenant: str, now: float) -> bool:
        """Whether a failure of ``tenant`` now would be the backend's (True) or its own."""
        self._advance(now)
        prev = self._latest.get(tenant)
        failing = self._failing + (0 if prev is not None and prev[1] else 1)
        succeeding_others = len(self._latest) - self._failing - (1 if prev is not None and not prev[1] else 0)
        if failing >= self.min_failing_tenants:
            return True
        return succeeding_others == 0 and (not self.probes or self._probe_failed(self._now))

    @property
    def probes(self) -> bool:
        """Whether a lone tenant's failure waits for Sluice's own probe (else it is the
        backend's)."""
        return self.config.own_probe_after_s > 0 and self.min_failing_tenants > 1

    def _probe_failed(self, now: float) -> bool:
        v = self._verdict
        return v is not None and v[1] and now - v[0] <= self.config.window_s

    def probe_wanted(self, now: float) -> bool:
        """A failure nobody else can vouch for waits for Sluice's own probe of the backend, and
        the last one is older than ``own_probe_after_s``."""
        now = self._advance(now)
        v = self._verdict
        return self._wanted and (v is None or now - v[0] >= self.config.own_probe_after_s)

    def probed(self, failed: bool, now: float) -> None:
        """How Sluice's own probe of the backend went (the caller records a failure on the
        backend's breakers too: it is the backend's, confirmed)."""
        now = self._advance(now)
        self._verdict, self._wanted = (now, failed), False

    def __len__(self) -> int:
        return len(self._breakers)

    def by_state(self, now: float) -> dict[str, int]:
        """How many tenant breakers are in each state (for the gauges)."""
        now = self._advance(now)
        return dict(Counter(b.state(now).value for b in self._breakers.values()))

    def snapshot(self, now: float) -> dict[str, Any]:
        """Counts, and the tenants whose breaker is not closed."""
        now = self._advance(now)
        tripped = {}
        for tenant, b in self._breakers.items():
            if b.state(now) is not BreakerState.CLOSED:
                snap = b.snapshot(now)
                tripped[tenant] = {"state": snap["state"], "retry_after_s": snap["cooldown_left_s"],
                                   "trips": snap["trips"], "last_cause": snap["last_cause"]}
        v = self._verdict
        return {"tracked_tenants": len(self._latest), "failing_tenants": self._failing,
                "breakers": len(self._breakers), "by_state": self.by_state(now), "tripped": tripped,
                "probe": None if v is None else {"age_s": round(now - v[0], 3),
                                                 "backend_failed": v[1]},
                "probe_wanted": self._wanted}

    def drain_events(self) -> list[tuple[str, BreakerEvent]]:
        """Every tenant breaker's transitions since the last call (the newest 1000 of dropped ones)."""
        out = list(self._events)
        self._events.clear()
        for tenant, b in self._breakers.items():
            out.extend((tenant, ev) for ev in b.drain_events())
        return out

    # -- updates ------------------------------------------------------------------------
    def record(self, tenant: str, outcome: Outcome | str, now: float, *, admitted: bool = True) -> Outcome:
        """Note how one of ``tenant``'s requests ended; returns what the backend's breakers should record.

        ``admitted``: the tenant's breaker let this request through (its verdict was
        allowed); only such requests report to it, as with the backend's breaker.
        """
        now = self._advance(now)
        outcome = Outcome(outcome)
        breaker = self._breakers.get(tenant)
        if outcome is Outcome.FAILURE:
            alone = not self.backend_to_blame(tenant, now)
            if alone and self.probes and not self._probe_failed(now) and self._lone(tenant):
                self._wanted = True
            if alone and breaker is None:
                breaker = self._create(tenant, now)
                alone = breaker is not None  # no room for one more: so many failing is the backend
            self._note(tenant, now, failed=True)
            if breaker is not None and admitted:
                # Blamed on the backend, it proves nothing about the tenant (a probe's place goes back).
                breaker.record(Outcome.FAILURE if alone else Outcome.CANCELLED, None, now)
            return Outcome.TENANT_FAILURE if alone else Outcome.FAILURE
        if outcome is Outcome.SUCCESS:
            self._note(tenant, now, failed=False)
        if breaker is not None and admitted:
            breaker.record(outcome, None, now)
        return outcome

    # -- internals ----------------------------------------------------------------------
    def _lone(self, tenant: str) -> bool:
        """No other tenant's latest outcome is a success: nobody vouches for the backend."""
        prev = self._latest.get(tenant)
        mine = 1 if prev is not None and not prev[1] else 0
        return len(self._latest) - self._failing - mine == 0

    def _advance(self, now: float) -> float:
        now = self._now = max(now, self._now)
        horizon = now - self.config.window_s
        while self._latest:
            tenant, (at, _) = next(iter(self._latest.items()))
            if at > horizon:
                break
            self._forget(tenant)
            b = self._breakers.get(tenant)
            if b is not None and b.state(now) is not BreakerState.OPEN:
                self._drop(tenant)
        return now

    def _note(self, tenant: str, now: float, failed: bool) -> None:
        if tenant in self._latest:
            self._forget(tenant)
        elif len(self._latest) >= self.max_tenants:
            self._forget(next(iter(self._latest)))
        self._latest[tenant] = (now, failed)
        self._failing += int(failed)

    def _forget(self, tenant: str) -> None:
        _, failed = self._latest.pop(tenant)
        self._failing -= int(failed)

    def _create(self, tenant: str, now: float) -> Breaker | None:
        if len(self._breakers) >= self.max_tenants:
            for idle in [t for t, b in self._breakers.items()
                         if t not in self._latest and b.state(now) is not BreakerState.OPEN]:
                self._drop(idle)
        if len(self._breakers) >= self.max_tenants:
            return None
        b = self._breakers[tenant] = Breaker(self.config, now)
        return b

    def _drop(self, tenant: str) -> None:
        b = self._breakers.pop(tenant)
        self._events.extend((tenant, ev) for ev in b.drain_events())
