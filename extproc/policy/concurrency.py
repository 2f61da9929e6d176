"""Adaptive concurrency limit per backend, driven by latency SLOs.

The KV watermark protects the cache; it says nothing about time. A backend whose
decode slows down (a thermal throttle, a noisy neighbour, long prompts prefilling)
keeps its KV usage and misses every latency target. This controller turns latency
samples into a concurrency limit between ``floor`` and ``ceiling`` (the backend's
``max_concurrency``); admission uses the smaller of it and the watermark's limit.

Samples are *normalised*: the caller divides each measured latency (time to first
token from admission, inter-token latency) by the SLO of the request's tier, so a
sample of 1.0 is exactly on target whatever the tier. Unlike Envoy's gradient
controller and Netflix's Gradient2, which have no target and must estimate the
unloaded latency (Envoy pins concurrency low to measure a minRTT; Gradient2 keeps a
long-window average as the baseline), the SLO *is* the baseline here, so there is no
probing phase that starves traffic. What is taken from them: a gradient
(target / observed), at least one slot, clipped so one window cuts at most ``1 - min_gradient`` of the
limit, growth by a headroom of about sqrt(limit) per window (so growth is quick from
small limits and gentle near the ceiling), smoothing on the way up, and no growth
while the limit is not even being used (an idle backend must not earn a huge limit).

Update rule, evaluated once per window (at least ``window_s`` long and holding at
least ``min_samples`` samples; a quiet backend keeps collecting):

* r = the ``quantile`` (nearest rank) of the window's normalised samples;
* r > 1 (the SLO is missed): limit <- max(floor, limit * max(min_gradient, 1 / r)),
  applied at once (overload is answered now, as the watermark does);
* r < ``tolerance`` and the window saw in-flight >= limit / 2:
  limit <- limit + smoothing * max(1, sqrt(limit)), at most ``ceiling``;
* otherwise (tolerance <= r <= 1, the dead band): the limit holds.

Why it does not oscillate: the dead band between ``tolerance`` and 1 is wider than
one growth step's effect, so a rising limit stops inside it instead of overshooting
past 1; and after a cut only samples of requests admitted after the cut count
towards the next decision, because those admitted earlier were measured under the
old, higher concurrency and would cut again for load that is already gone.

``at_risk(tier)`` is true for ``risk_hold_s`` after a window in which that tier's
own samples missed their SLO (r > 1): admission then moves the ladders of lower
tiers first, as it does under KV pressure.

Pure: no I/O, no clock; ``now`` is passed in (monotonic seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from extproc.policy.model import AdaptiveSettings

_DEFAULTS = AdaptiveSettings()

__all__ = ["AdaptiveConfig", "AdaptiveLimit", "quantile"]

MAX_WINDOW_SAMPLES = 4096


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of a non-empty list (q in [0, 1]); q=0.99 of 20 samples is the max."""
    s = sorted(values)
    rank = max(1, math.ceil(q * len(s)))
    return s[rank - 1]


@dataclass(frozen=True)
class AdaptiveConfig:
    # The policy's defaults (AdaptiveSettings) are the one source; the ceiling is the backend's.
    ceiling: int
    floor: int = _DEFAULTS.floor
    window_s: float = _DEFAULTS.window_s
    min_samples: int = _DEFAULTS.min_samples
    quantile: float = _DEFAULTS.quantile
    tolerance: float = _DEFAULTS.tolerance
    smoothing: float = _DEFAULTS.smoothing
    min_gradient: float = _DEFAULTS.min_gradient
    risk_hold_s: float = _DEFAULTS.risk_hold_s

    def __post_init__(self) -> None:
        if self.ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {self.ceiling}")
        if self.floor < 1:
            raise ValueError(f"floor must be >= 1, got {self.floor}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not 0 < self.tolerance <= 1:
            raise ValueError(f"tolerance must be in (0, 1], got {self.tolerance}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 < self.min_gradient < 1:
            raise ValueError(f"min_gradient must be in (0, 1), got {self.min_gradient}")


class AdaptiveLimit:
    """A concurrency limit in [floor, ceiling] that follows normalised latency samples."""

    def __init__(self, cfg: AdaptiveConfig, now: float) -> None:
        self.cfg = cfg
        # Start at the ceiling: the watermark still guards the cache, and a fresh
        # replica should not throttle a calm backend while it learns.
        self._limit = float(cfg.ceiling)
        self._window_start = now
        self._samples: list[float] = []
        self._by_tier: dict[str, list[float]] = {}
        self._max_in_flight = 0
        self._cut_at = -math.inf  # samples of requests admitted before this do not count
        self._risk_until: dict[str, float] = {}
        self.last_ratio: float | None = None
        self.last_ratio_by_tier: dict[str, float] = {}
        self.windows = 0
        self.cuts = 0

    # -- configuration ---------------------------------------------------------------
    def reconfigure(self, cfg: AdaptiveConfig) -> None:
        """New settings (a policy reload) keep the learned limit, clipped to the new bounds."""
        self.cfg = cfg
        self._limit = self._clip(self._limit)

    # -- inputs ----------------------------------------------------------------------
    def observe(self, tier: str, ratio: float, admitted_at: float, in_flight: int, now: float) -> None:
        """One normalised latency sample (latency / the tier's SLO) of a request that
        was admitted at ``admitted_at``, with ``in_flight`` requests on the backend."""
        if not math.isfinite(ratio) or ratio < 0:
            return
        self._max_in_flight = max(self._max_in_flight, in_flight)
        tier_samples = self._by_tier.setdefault(tier, [])
        if len(tier_samples) < MAX_WINDOW_SAMPLES:
            tier_samples.append(ratio)
        if admitted_at >= self._cut_at and len(self._samples) < MAX_WINDOW_SAMPLES:
            self._samples.append(ratio)
        self.update(now)

    def note_in_flight(self, in_flight: int) -> None:
        """The backend's in-flight count at an admission: evidence the limit is used."""
        self._max_in_flight = max(self._max_in_flight, in_flight)

    def update(self, now: float) -> None:
        """Close the window if it is due (long enough and with enough samples)."""
        if now - self._window_start < self.cfg.window_s:
            return
        for tier, values in self._by_tier.items():
            if len(values) >= self.cfg.min_samples:
                r = quantile(values, self.cfg.quantile)
                self.last_ratio_by_tier[tier] = r
                if r > 1.0:
                    self._risk_until[tier] = now + self.cfg.risk_hold_s
        if len(self._samples) < self.cfg.min_samples:
            # Not enough evidence yet: keep collecting (per-tier lists restart so the
            # risk view stays recent).
            self._by_tier = {t: v for t, v in self._by_tier.items() if len(v) < self.cfg.min_samples}
            return
        r = quantile(self._samples, self.cfg.quantile)
        self.last_ratio = r
        self.windows += 1
        limit = self._limit
        if r > 1.0:
            # At least one whole slot: a ratio just over 1 would otherwise shave a fraction
            # per window and take dozens of windows to cross the next integer limit.
            new = min(limit * max(self.cfg.min_gradient, 1.0 / r), limit - 1.0)
            self._limit = self._clip(new)
            if self._limit < limit:
                self.cuts += 1
                self._cut_at = now
        elif r < self.cfg.tolerance and self._max_in_flight * 2 >= limit:
            step = self.cfg.smoothing * max(1.0, math.sqrt(limit))
            self._limit = self._clip(limit + step)
        self._window_start = now
        self._samples = []
        self._by_tier = {}
        self._max_in_flight = 0

    # -- outputs ---------------------------------------------------------------------
    def limit(self, now: float) -> int:
        self.update(now)
        return int(self._limit)

    def scale(self, now: float) -> float:
        """The limit as a fraction of the ceiling, the form the slot pool takes."""
        return self.limit(now) / self.cfg.ceiling

    def at_risk(self, tier: str, now: float) -> bool:
        return now < self._risk_until.get(tier, -math.inf)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {"limit": self.limit(now), "ceiling": self.cfg.ceiling, "floor": self.cfg.floor,
                "last_ratio": None if self.last_ratio is None else round(self.last_ratio, 4),
                "ratio_by_tier": {t: round(r, 4) for t, r in self.last_ratio_by_tier.items()},
                "at_risk": sorted(t for t in self._risk_until if self.at_risk(t, now)),
                "windows": self.windows, "cuts": self.cuts}

    def _clip(self, v: float) -> float:
        floor = min(self.cfg.floor, self.cfg.ceiling)
        return max(float(floor), min(float(self.cfg.ceiling), v))
