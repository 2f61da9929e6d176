"""Settles that wait for Envoy's access log (``response_processing: access_log``).

Under ``access_log`` the ext_proc stream ends once the request side is answered, before
the backend does; the request's settle waits here, keyed by the ``sluice.settle`` id its
answer wrote into Envoy's dynamic metadata, until its entry arrives
(``extproc.wire.access_log``): entries come batched, off every request's critical path.

Nothing is lost or billed twice:

- every waiting request has an expiry (``expires_after_s`` from when it was forwarded:
  the route's ``response_timeout_s``, after which Envoy has ended the response, plus a
  margin for the log's flush): an entry that never comes (Envoy's log stream broke, the
  entry was dropped) cannot hold a slot or KV beyond it. An expired request keeps its
  pre-charge (nothing says what it used) and tells its breakers nothing;
- an entry is taken once: the id is forgotten when it settles, and an entry that comes
  after its request expired is ignored and counted (``late``), as is one for an id this
  process never had (``unknown``).

With a shared store, a replica that dies with requests waiting here gives their slots
back the way it gives back every other: its leases expire (``extproc.store``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.request.outcome import ResponseOutcome, from_log_entry, settle_id
from extproc.runtime.metrics import Metrics

log = logging.getLogger("sluice.log_settle")

# Past the route's response timeout: Envoy's flush interval, its local reply, a retry.
MARGIN_S = 10.0
NO_TIMEOUT_EXPIRY_S = 3600.0  # response_timeout_s 0 (no route timeout): still bounded
LATE_REMEMBERED = 10_000  # expired ids kept to tell a late entry from an unknown one


class Awaiting(Protocol):
    """A forwarded request whose settle waits for its entry (``extproc.request.stream``)."""

    arrived_s: float

    def settle_with(self, outcome: ResponseOutcome) -> None: ...

    def settle_expired(self) -> None: ...


def expires_after_s(response_timeout_s: float) -> float:
    """How long a forwarded request waits for its entry before it settles by expiry."""
    return (response_timeout_s if response_timeout_s > 0 else NO_TIMEOUT_EXPIRY_S) + MARGIN_S


class LogSettles:
    def __init__(self, sink: str, clock: Callable[[], float], metrics: Metrics) -> None:
        self.sink = sink  # this process's sink key (extproc.envoy.access_log.sink_key)
        self.clock = clock
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._waiting: dict[str, tuple[Awaiting, float]] = {}  # id -> (request, its expiry)
        # (expiry, id), a heap; ids settled from their entry stay until rebuilt (_compact)
        self._deadlines: list[tuple[float, str]] = []
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._warned_at = -60.0

    def __len__(self) -> int:
        return len(self._waiting)

    def register(self, request: Awaiting, expires_at: float) -> str:
        """Wait for ``request``'s entry until ``expires_at`` (the runtime clock); the id to
        write into its ``sluice.settle`` metadata."""
        key = f"{self.sink}/{next(self._ids)}"
        self._waiting[key] = (request, expires_at)
        heapq.heappush(self._deadlines, (expires_at, key))
        if len(self._deadlines) > 2 * len(self._waiting) + 1024:
            self._compact()
        self.metrics.log_awaiting.set(len(self._waiting))
        return key

    def _compact(self) -> None:
        """Drop the heap's settled ids: at 2,000 requests/s, a 600 s expiry would otherwise
        keep 1.2 M of them. Linear, and at most once per as many registrations."""
        self._deadlines = [(at, key) for key, (_, at) in self._waiting.items()]
        heapq.heapify(self._deadlines)

    def forget(self, key: str) -> None:
        """``key``'s request settled another way (refused after it was registered)."""
        if self._waiting.pop(key, None) is not None:
            self.metrics.log_awaiting.set(len(self._waiting))

    def consume(self, entries: Sequence[accesslog_pb2.HTTPAccessLogEntry]) -> None:
        """Settle the requests of a batch of entries (``extproc.wire.access_log``'s sink)."""
        now = self.clock()
        for entry in entries:
            key = settle_id(entry)
            if key is None:
                continue
            waiting = self._waiting.pop(key, None)
            if waiting is None:
                late = key in self._expired
                self.metrics.log_entry_unmatched(late=late)
                if not late and not key.startswith(self.sink + "/"):
                    self._misrouted(key)
                continue
            request = waiting[0]
            t0 = time.perf_counter()
            outcome = from_log_entry(entry)
            try:
                request.settle_with(outcome)
            except Exception:  # one request's settle must not cost the batch's others theirs
                log.exception("settling %s from its access-log entry failed", key)
                continue
            ended = outcome.ended_after_s
            self.metrics.log_settled(now - request.arrived_s - ended if ended is not None else 0.0)
            # The settle's handler time, as the response phases' is under the other modes.
            self.metrics.phase("access_log", time.perf_counter() - t0)
        self.metrics.log_awaiting.set(len(self._waiting))

    def _misrouted(self, key: str) -> None:
        """An entry of another sink: Envoy's log for one endpoint reaches several processes
        (one name for several replicas), and their requests wait for their expiry."""
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            log.error("access-log entry %s belongs to another process (this one is %s): Envoy's config must "
                      "name each Sluice process as its own ext_proc endpoint (serve --advertise), or use "
                      "response_processing usage_trailers", key, self.sink)

    def expire(self, now: float) -> int:
        """Settle every request whose entry did not come by its expiry; how many did."""
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            waiting = self._waiting.pop(key, None)
            if waiting is None:
                continue  # settled from its entry already
            request = waiting[0]
            expired += 1
            self._expired[key] = None
            if len(self._expired) > LATE_REMEMBERED:
                self._expired.popitem(last=False)
            self.metrics.log_settle_expired()
            try:
                request.settle_expired()
            except Exception:
                log.exception("settling %s by expiry failed", key)
        if expired:
            log.warning("%d forwarded requests settled by expiry: no access-log entry came for them", expired)
            self.metrics.log_awaiting.set(len(self._waiting))
        return expired

    def next_expiry(self) -> float | None:
        """The earliest expiry still pending (settled entries included: a bound, not exact)."""
        return self._deadlines[0][0] if self._deadlines else None
