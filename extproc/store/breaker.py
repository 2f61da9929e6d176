"""The store's own breaker: is Redis answering? Drives ``sluice_state_store_up``.

Opened by an error or an exchange unanswered within its bound (``extproc.store.round_trips``); closed by any
answer (a late one ends a false alarm at once) or a probe every ``probe_s``. A loaded
host makes short false alarms, so they are logged at most once per ``LOG_EVERY_S``;
an outage of half a second or more logs its end.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("sluice.store")

LOG_EVERY_S = 10.0


class StoreBreaker:
    def __init__(self, probe_s: float, on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.probe_s, self.clock = probe_s, clock
        self.on_change = on_change or (lambda up: None)
        self.up = True
        self.trips = 0  # times it opened
        self.probe_at = 0.0
        self._down_since = 0.0
        self._logged_at, self._trips_logged = -math.inf, 0
        self.on_change(True)

    def trip(self, why: str) -> None:
        now = self.clock()
        if self.up:
            self.up = False
            self.trips += 1
            self._down_since = now
            if now - self._logged_at >= LOG_EVERY_S:
                log.warning("state store unreachable (%s): admitting within the local share "
                            "(%d alarms since the last line)", why, self.trips - self._trips_logged)
                self._logged_at, self._trips_logged = now, self.trips
            self.on_change(False)
        self.probe_at = now + self.probe_s

    def answered(self) -> bool:
        """Redis answered; True when that closed the breaker."""
        if self.up:
            return False
        self.up = True
        down = self.clock() - self._down_since
        if down >= 0.5:
            log.warning("state store reachable again after %.1fs: reconciling local charges", down)
        self.on_change(True)
        return True

    def probe_due(self, now: float) -> bool:
        return not self.up and now >= self.probe_at
