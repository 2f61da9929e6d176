"""KV-cache watermark -> capacity scale factor, with smoothing and slow recovery.

The backend's KV-cache usage (``vllm:kv_cache_usage_perc``, 0..1) and its waiting
queue (``vllm:num_requests_waiting``) are scraped about once a second. The scale
factor multiplies the concurrency budget and the TPM/RPM buckets of that backend:
1.0 below the low watermark (70 %), ``floor`` at or above the high watermark (85 %),
linear in between. :func:`scale_for` is that curve; :class:`WatermarkController`
turns a stream of noisy, possibly missing samples into a scale that drops fast and
recovers slowly.

Pure: no I/O, no clock; ``now`` is passed in (seconds, monotonic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WatermarkController", "WatermarkState", "scale_for"]


def _check_curve(high: float, low: float, floor: float) -> None:
    if not (math.isfinite(high) and math.isfinite(low) and 0.0 <= low < high):
        raise ValueError(f"need 0 <= low < high, got low={low!r} high={high!r}")
    if not 0.0 <= floor <= 1.0:  # also rejects NaN
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")


def scale_for(usage: float, high: float = 0.85, low: float = 0.70, floor: float = 0.6) -> float:
    """The watermark curve: ``floor`` at/above ``high``, 1.0 at/below ``low``, linear between.

    A NaN usage is an unreadable metric and maps to ``floor`` (never to "idle").
    """
    _check_curve(high, low, floor)
    if math.isnan(usage) or usage >= high:
        return floor
    if usage <= low:
        return 1.0
    return floor + (1.0 - floor) * (high - usage) / (high - low)


@dataclass(frozen=True, slots=True)
class WatermarkState:
    """A status-report view of the controller at one instant.

    ``reason`` is one of: ``no_data``, ``unreachable``, ``stale`` (scale held at
    floor), ``queue`` (waiting queue over threshold), ``queue_growing`` (recovery
    paused), ``kv`` (usage above the low watermark), ``recovering`` (ramping up
    towards the target), ``ok`` (full capacity).
    """

    scale: float
    target: float
    smoothed_usage: float | None
    smoothed_waiting: float | None
    reason: str


class WatermarkController:
    """Smooths backend load samples into a capacity scale in [floor, 1].

    Rules, and why:

    * Usage and waiting are smoothed with an EWMA (``alpha`` = weight of the new
      sample, per sample since scrapes are periodic). One noisy scrape should not
      swing admission; with alpha 0.5 a lone spike moves the smoothed value half
      way, while sustained saturation reaches the high watermark within a few
      samples.
    * Pressure = smoothed usage, raised to ``high`` when the smoothed waiting queue
      exceeds ``waiting_threshold``: a backend that queues is past its batch
      capacity whatever its KV usage says. A *growing* queue (raw sample above the
      previous one) does not cut capacity but pauses recovery: the backend is not
      keeping up, so handing it more would be premature.
    * The scale drops immediately to a lower target (overload must be answered at
      once, an OOM does not wait) but rises at most ``recover_per_s`` per second.
      Fast-down/slow-up is what keeps the loop from oscillating: restoring full
      capacity in one step refills the KV cache in one step, which trips the high
      watermark again (the seeds warn of exactly this).
    * Stale metrics (no observation for more than ``stale_after_s``) and
      unreachable ones (``usage`` None or NaN) count as saturated: scale = floor.
      Silence from a backend is more often overload or a restart than idleness.
      The next good sample re-seeds the EWMA (the old average describes a backend
      state we lost track of) and the scale ramps up from floor.
    * Before the first good sample the scale is ``floor``. The very first good
      sample sets the scale straight to its target: there is no earlier state to
      oscillate from, and a fresh replica should not throttle a calm backend for
      ``(1 - floor) / recover_per_s`` seconds.

    The ramp is evaluated piecewise between events (observations and the stale
    deadline), so the result does not depend on how often :meth:`scale` is called.
    Time that goes backwards is clamped to the latest time seen.
    """

    def __init__(
        self,
        high: float = 0.85,
        low: float = 0.70,
        floor: float = 0.6,
        alpha: float = 0.5,
        recover_per_s: float = 0.05,
        stale_after_s: float = 5.0,
        waiting_threshold: float = 8.0,
    ) -> None:
        _check_curve(high, low, floor)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not recover_per_s > 0.0:
            raise ValueError(f"recover_per_s must be > 0, got {recover_per_s!r}")
        if not stale_after_s > 0.0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        if not waiting_threshold >= 0.0:
            raise ValueError(f"waiting_threshold must be >= 0, got {waiting_threshold!r}")
        self.high = high
        self.low = low
        self.floor = floor
        self.alpha = alpha
        self.recover_per_s = recover_per_s
        self.stale_after_s = stale_after_s
        self.waiting_threshold = waiting_threshold

        self._scale = floor
        self._t: float | None = None  # time up to which the ramp has been evaluated
        self._seeded = False  # ever had a good sample
        self._unreachable = False
        self._last_obs_t: float | None = None
        self._usage: float | None = None  # EWMA
        self._waiting: float | None = None  # EWMA
        self._last_waiting_raw: float | None = None
        self._growing = False
        # Called at every sample: a cache of what scale() and state() say (a pool's placement
        # index) is renewed then, and at next_change().
        self.on_change: Callable[[], None] | None = None
        # state(now) again at the same now (placement asks each endpoint three times a
        # request) is the same state until the next observe
        self._state_at: tuple[float, WatermarkState] | None = None

    # -- inputs ------------------------------------------------------------------------

    def observe(self, usage: float | None, waiting: float | None, now: float) -> None:
        """Feed one scrape. ``usage`` None/NaN = metrics unreachable; ``waiting`` None =
        the backend does not export a queue length (ignored, not treated as pressure)."""
        if self.on_change is not None:
            self.on_change()
        self._state_at = None
        if self._t is not None:
            now = max(now, self._t)
        self._advance(now)
        fresh = self._seeded and not self._unreachable and not self._stale_at(now)
        self._last_obs_t = now
        self._t = now

        if usage is None or math.isnan(usage):
            self._unreachable = True
            self._usage = self._waiting = self._last_waiting_raw = None
            self._growing = False
            self._scale = self.floor
            return

        self._usage = self._smooth(self._usage if fresh else None, usage)
        if waiting is None or math.isnan(waiting):
            self._waiting = self._last_waiting_raw = None
            self._growing = False
        else:
            w = max(0.0, waiting)
            previous = self._last_waiting_raw if fresh else None
            self._growing = previous is not None and w > previous
            self._waiting = self._smooth(self._waiting if fresh else None, w)
            self._last_waiting_raw = w

        first = not self._seeded
        self._seeded = True
        self._unreachable = False
        target = self._target()
        if first or target < self._scale:
            self._scale = target

    # -- outputs -----------------------------------------------------------------------

    def scale(self, now: float) -> float:
        """The capacity scale in [floor, 1] at ``now``."""
        self._advance(now)
        return self._scale

    def next_change(self, now: float) -> float:
        """The earliest time at which ``scale`` or ``state`` may change with no new sample:
        ``now`` while the scale moves (ramping up), the stale deadline while the metrics are
        fresh, inf once they are stale, unreachable or not seen yet."""
        self._advance(now)
        t = self._t_or(now)
        if not self._seeded or self._unreachable or self._stale_at(t):
            return math.inf
        target = self._target()
        if self._scale != target and not (self._growing and self._scale < target):
            return t
        assert self._last_obs_t is not None
        return self._last_obs_t + self.stale_after_s

    def state(self, now: float) -> WatermarkState:
        cached = self._state_at
        if cached is not None and cached[0] == now:
            return cached[1]
        scale = self.scale(now)
        target = self.floor if self._stale_at(self._t_or(now)) else self._target()
        st = WatermarkState(
            scale=scale,
            target=target,
            smoothed_usage=self._usage,
            smoothed_waiting=self._waiting,
            reason=self._reason(scale, target, now),
        )
        self._state_at = (now, st)
        return st

    # -- internals ---------------------------------------------------------------------

    def _t_or(self, now: float) -> float:
        return now if self._t is None else max(now, self._t)

    def _smooth(self, previous: float | None, sample: float) -> float:
        if previous is None:
            return sample
        return self.alpha * sample + (1.0 - self.alpha) * previous

    def _stale_at(self, t: float) -> bool:
        return self._last_obs_t is None or t - self._last_obs_t > self.stale_after_s

    def _target(self) -> float:
        """Target scale from the last good sample, ignoring staleness."""
        if not self._seeded or self._unreachable or self._usage is None:
            return self.floor
        pressure = self._usage
        if self._waiting is not None and self._waiting > self.waiting_threshold:
            pressure = max(pressure, self.high)
        return scale_for(pressure, self.high, self.low, self.floor)

    def _ramp_to(self, t: float) -> None:
        assert self._t is not None
        dt = t - self._t
        target = self._target()
        if target <= self._scale:
            self._scale = target
        elif dt > 0.0 and not self._growing:
            self._scale = min(target, self._scale + self.recover_per_s * dt)
        self._t = t

    def _advance(self, now: float) -> None:
        if self._t is None:
            self._t = now
            return
        if now <= self._t:
            return
        if self._stale_at(self._t):
            self._scale = self.floor
            self._t = now
            return
        assert self._last_obs_t is not None
        deadline = self._last_obs_t + self.stale_after_s
        if deadline < now:
            # Metrics go stale part way through this interval: ramp up to the
            # deadline, then hold at floor.
            self._ramp_to(deadline)
            self._scale = self.floor
            self._t = now
        else:
            self._ramp_to(now)

    def _reason(self, scale: float, target: float, now: float) -> str:
        if not self._seeded and not self._unreachable:
            return "no_data"
        if self._unreachable:
            return "unreachable"
        if self._stale_at(self._t_or(now)):
            return "stale"
        if self._waiting is not None and self._waiting > self.waiting_threshold:
            return "queue"
        if target < 1.0:
            return "kv"
        if scale < target:
            return "queue_growing" if self._growing else "recovering"
        return "ok"
