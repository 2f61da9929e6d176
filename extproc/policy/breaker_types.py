"""What a breaker says: its states, a verdict on one request and a transition event.

Apart from ``extproc.policy.breaker`` (the machine) so that readers of verdicts and
events need not import the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

__all__ = ["REASON_HALF_OPEN_THROTTLE", "REASON_MANUAL_OPEN", "REASON_OPEN", "BreakerEvent",
           "BreakerState", "BreakerVerdict"]

REASON_OPEN = "breaker_open"
REASON_HALF_OPEN_THROTTLE = "breaker_half_open_throttle"
REASON_MANUAL_OPEN = "breaker_manual_open"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerVerdict:
    allowed: bool
    state: BreakerState
    reason: str | None = None  # None when allowed
    retry_after_s: float | None = None


class BreakerEvent(NamedTuple):
    at: float
    from_state: BreakerState
    to_state: BreakerState
    cause: str  # a label-safe token: error_ratio, manual_open, recovered, ...
