"""How long Redis takes to answer, smoothed: a slow answer counts as a failure only past
what recent answers took.

A fixed bound (8 ms for an exchange) fits a quiet host; on a busy one (Redis and the
replica share cores with other work) answers of 10-30 ms are normal, and a fixed bound
trips the store's breaker on a store that is answering. Every request then falls back
to the local share, which started empty then, and a tenant far from its budget got 429
(the share now starts from the room last seen: ``extproc.policy.lease.local_share``).
The bound here follows the answers: the larger of RFC 6298's estimate (as TCP's
retransmission timer: the smoothed time plus four times its variation) and 1.5 times
the slowest recent answer (a peak that fades by ``PEAK_FADE`` per answer, so a run of
quick answers between slow ones does not bring the bound under what the slow ones
took), never below the floor
(a quiet host keeps today's quick failover) nor above the ceiling (the socket timeout,
where the client gives up anyway). A frozen Redis still trips within the bound its last
answers set. Pure: times are passed in.
"""

from __future__ import annotations

__all__ = ["RoundTrips"]

_ALPHA = 0.125  # weight of a new sample in the smoothed time (RFC 6298)
_BETA = 0.25  # weight of a new sample's deviation in the variation
PEAK_FADE = 0.95  # per answer: the slowest recent answer halves in weight after ~14 quick ones
PEAK_MARGIN = 1.5


class RoundTrips:
    def __init__(self, floor_s: float, ceiling_s: float) -> None:
        self.floor_s, self.ceiling_s = floor_s, max(floor_s, ceiling_s)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.peak = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.peak = max(seconds, self.peak * PEAK_FADE)
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
            return
        self.rttvar = (1 - _BETA) * self.rttvar + _BETA * abs(self.srtt - seconds)
        self.srtt = (1 - _ALPHA) * self.srtt + _ALPHA * seconds

    def bound(self) -> float:
        """How long to wait for an answer before taking the store for unreachable."""
        if self.srtt is None:
            # Nothing measured yet: wait as long as the client would (RFC 6298 starts with a
            # conservative timer too). A first exchange, which also loads the scripts, on a
            # busy host can take longer than the floor, and a trip then refuses every request
            # of a replica that has not registered yet.
            return self.ceiling_s
        estimate = max(self.srtt + 4 * self.rttvar, PEAK_MARGIN * self.peak)
        return min(self.ceiling_s, max(self.floor_s, estimate))
