"""Token bucket with pre-charge and settle, for TPM and RPM limits.

A request is charged its *estimated* cost when it is admitted (pre-charge: prompt
tokens plus ``max_tokens`` for TPM, 1 for RPM). Because the cost is taken at
admission, concurrent requests can never overshoot the bucket together. When the
request ends, :meth:`TokenBucket.settle` corrects the estimate: unused tokens are
refunded, and usage beyond the estimate is charged as debt (the level goes
negative, and refill repays the debt before anything new is admitted).

Pure: no clock, no I/O. Every call that depends on time takes ``now`` (seconds,
monotonic). Time that goes backwards adds no tokens.

Watermark scaling: the policy's base numbers are scaled and handed to
:meth:`TokenBucket.reconfigure`, e.g.
``bucket.reconfigure(base_capacity * scale, base_rate_per_s * scale, now)``.
Reconfiguring keeps the current level (clamped to the new capacity) and never
refills for free, so scaling down and back up cannot mint tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Charge", "Ledger", "TokenBucket"]


@dataclass(frozen=True, slots=True)
class Charge:
    """The outcome of :meth:`TokenBucket.try_charge`.

    ``retry_after_s`` is 0 when admitted, ``math.inf`` when the cost exceeds the
    capacity (or the rate is 0), else the time until refill at the current rate
    covers the cost (ignoring other traffic). ``remaining`` is the level after
    the call (after subtracting the cost if admitted).
    """

    admitted: bool
    retry_after_s: float
    remaining: float


def _check_finite_nonneg(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


class TokenBucket:
    """A continuously refilling token bucket whose level may go negative (debt)."""

    __slots__ = ("_capacity", "_rate", "_level", "_t")

    def __init__(
        self,
        capacity: float,
        rate_per_s: float,
        now: float,
        level: float | None = None,
    ) -> None:
        _check_finite_nonneg("capacity", capacity)
        _check_finite_nonneg("rate_per_s", rate_per_s)
        self._capacity = float(capacity)
        self._rate = float(rate_per_s)
        self._t = float(now)
        if level is None:
            self._level = self._capacity
        else:
            if math.isnan(level):
                raise ValueError("level must not be NaN")
            # A negative starting level (restored debt) is allowed; above capacity is not.
            self._level = min(self._capacity, float(level))

    @property
    def capacity(self) -> float:
        return self._capacity

    @property
    def rate_per_s(self) -> float:
        return self._rate

    def _level_at(self, now: float) -> float:
        # Clamp elapsed at 0: a clock that steps backwards must not add tokens.
        elapsed = max(0.0, now - self._t)
        if self._level >= self._capacity:
            return self._level
        return min(self._capacity, self._level + self._rate * elapsed)

    def _advance(self, now: float) -> None:
        self._level = self._level_at(now)
        # Never move the reference time backwards, or the next forward step would
        # count the same interval twice.
        if now > self._t:
            self._t = now

    def _time_to_reach(self, target: float, level: float) -> float:
        deficit = target - level
        if deficit <= 0:
            return 0.0
        if self._rate <= 0:
            return math.inf
        return deficit / self._rate

    def try_charge(self, cost: float, now: float) -> Charge:
        """Admit and subtract ``cost`` if the level covers it; otherwise say when it will."""
        _check_finite_nonneg("cost", cost)
        self._advance(now)
        if cost > self._capacity:
            return Charge(admitted=False, retry_after_s=math.inf, remaining=self._level)
        if self._level >= cost:
            self._level -= cost
            return Charge(admitted=True, retry_after_s=0.0, remaining=self._level)
        return Charge(
            admitted=False,
            retry_after_s=self._time_to_reach(cost, self._level),
            remaining=self._level,
        )

    def settle(self, reserved: float, actual: float, now: float) -> None:
        """Correct a pre-charge of ``reserved`` to the ``actual`` usage.

        A refund is capped at capacity; an excess is charged in full and may leave
        the level negative (debt), which refill repays before new admissions.
        """
        _check_finite_nonneg("reserved", reserved)
        _check_finite_nonneg("actual", actual)
        self._advance(now)
        delta = reserved - actual
        if delta > 0:
            self._level = min(self._capacity, self._level + delta)
        else:
            self._level += delta

    def reconfigure(self, capacity: float, rate_per_s: float, now: float) -> None:
        """Change capacity and rate (policy change or watermark scaling).

        Tokens accrued up to ``now`` are counted at the old rate; the level is
        then kept, clamped to the new capacity. Growing the capacity does not
        fill the bucket: new room is filled by refill at the new rate.
        """
        _check_finite_nonneg("capacity", capacity)
        _check_finite_nonneg("rate_per_s", rate_per_s)
        self._advance(now)
        self._capacity = float(capacity)
        self._rate = float(rate_per_s)
        self._level = min(self._level, self._capacity)

    def remaining(self, now: float) -> float:
        """The level at ``now`` (negative while in debt). Does not change state."""
        return self._level_at(now)

    def reset_after_s(self, now: float) -> float:
        """Seconds until the bucket is full again (0 if full, inf if it never refills)."""
        return self._time_to_reach(self._capacity, self._level_at(now))

    def refill_s(self, level: float) -> float:
        """``reset_after_s`` from a level already read (``remaining``) at the same time."""
        return self._time_to_reach(self._capacity, level)

    def __repr__(self) -> str:
        return (
            f"TokenBucket(capacity={self._capacity!r}, rate_per_s={self._rate!r}, "
            f"level={self._level!r}, t={self._t!r})"
        )


def _check_tokens(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


@dataclass(slots=True)
class Ledger:
    """Integer accounting of pre-charges and their settlement (for metrics and tests).

    Definitions, per settled request with pre-charge ``reserved`` and usage ``actual``:

    - ``charged``  += actual                      (what was really used)
    - ``refunded`` += max(0, reserved - actual)   (estimate not used)
    - ``excess``   += max(0, actual - reserved)   (usage beyond the estimate)
    - ``outstanding`` -= reserved                 (no longer in flight)

    Each settle satisfies ``reserved + excess_i == actual + refund_i``, so at all
    times ``precharged + excess == charged + refunded + outstanding``; once every
    pre-charge has settled (``outstanding == 0``) that is
    ``precharged + excess == charged + refunded`` exactly.

    ``refunded`` counts refunds owed to the request. The bucket may keep less
    (a refund is capped at its capacity); that is the bucket's business.
    """

    precharged: int = 0
    charged: int = 0
    refunded: int = 0
    excess: int = 0
    outstanding: int = 0

    def record_precharge(self, n: int) -> None:
        _check_tokens("n", n)
        self.precharged += n
        self.outstanding += n

    def record_settle(self, reserved: int, actual: int) -> None:
        _check_tokens("reserved", reserved)
        _check_tokens("actual", actual)
        if reserved > self.outstanding:
            # Settling more than is in flight means a double settle somewhere: fail loudly.
            raise ValueError(
                f"settle of {reserved} exceeds outstanding pre-charges ({self.outstanding})"
            )
        self.outstanding -= reserved
        self.charged += actual
        if reserved >= actual:
            self.refunded += reserved - actual
        else:
            self.excess += actual - reserved

    def balanced(self) -> bool:
        """The ledger invariant: ``precharged + excess == charged + refunded + outstanding``."""
        return self.precharged + self.excess == self.charged + self.refunded + self.outstanding
