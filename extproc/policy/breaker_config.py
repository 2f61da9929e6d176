"""The breaker's tunables, checked once at construction so a bad policy fails at load
rather than mid-trip. The fields are explained in ``extproc.policy.breaker``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BreakerConfig"]


@dataclass(frozen=True)
class BreakerConfig:
    window_s: float = 30.0
    window_buckets: int = 30
    min_requests: int = 20
    error_ratio: float = 0.5
    consecutive_failures: int = 5  # 0 disables
    latency_slo_s: float | None = None  # None disables the latency trip
    latency_breach_ratio: float = 0.5
    cooldown_s: float = 30.0
    max_cooldown_s: float = 120.0
    cooldown_multiplier: float = 2.0
    cooldown_reset_s: float = 300.0  # healthy CLOSED time that resets cooldown growth
    ramp_steps: Sequence[float] = (0.1, 0.25, 0.5, 1.0)
    ramp_step_s: float = 10.0
    probe_successes: int = 1
    probe_timeout_s: float = 30.0
    # Half-open with no probe for this long (light traffic, or placement sending it
    # elsewhere): Sluice sends one of its own (``Breaker.probe_due``). Also the least time
    # between two of Sluice's probes confirming a failure nobody else can vouch for
    # (``tenant_breakers``). 0: no probes of Sluice's own.
    own_probe_after_s: float = 5.0
    throttle_retry_after_s: float = 1.0
    trip_on_preemption: bool = True
    preemption_threshold: float = 1.0  # counter increase within window_s that trips

    def __post_init__(self) -> None:
        object.__setattr__(self, "ramp_steps", tuple(float(s) for s in self.ramp_steps))
        steps = self.ramp_steps
        problems = [
            (self.window_s > 0, "window_s must be > 0"),
            (self.window_buckets >= 1, "window_buckets must be >= 1"),
            (self.min_requests >= 1, "min_requests must be >= 1"),
            (0 < self.error_ratio <= 1, "error_ratio must be in (0, 1]"),
            (self.consecutive_failures >= 0, "consecutive_failures must be >= 0"),
            (self.latency_slo_s is None or self.latency_slo_s > 0, "latency_slo_s must be > 0"),
            (0 < self.latency_breach_ratio <= 1, "latency_breach_ratio must be in (0, 1]"),
            (0 < self.cooldown_s <= self.max_cooldown_s, "need 0 < cooldown_s <= max_cooldown_s"),
            (self.cooldown_multiplier >= 1, "cooldown_multiplier must be >= 1"),
            (self.cooldown_reset_s >= 0, "cooldown_reset_s must be >= 0"),
            (bool(steps) and all(0 < s <= 1 for s in steps), "ramp_steps must be in (0, 1]"),
            (list(steps) == sorted(steps), "ramp_steps must not decrease"),
            (self.ramp_step_s >= 0, "ramp_step_s must be >= 0"),
            (self.probe_successes >= 1, "probe_successes must be >= 1"),
            (self.probe_timeout_s > 0, "probe_timeout_s must be > 0"),
            (self.own_probe_after_s >= 0, "own_probe_after_s must be >= 0"),
            (self.preemption_threshold > 0, "preemption_threshold must be > 0"),
        ]
        errors = [msg for ok, msg in problems if not ok]
        if errors:
            raise ValueError("; ".join(errors))
