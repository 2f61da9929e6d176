"""The core's live objects, built from the policy's settings: one place builds each.

A backend and each endpoint of a pool get their breaker and watermark controller
from here, so an endpoint is judged exactly as a single-address backend would be.
"""

from __future__ import annotations

from extproc.policy.breaker import Breaker
from extproc.policy.concurrency import AdaptiveConfig
from extproc.policy.schema import Backend, BreakerSettings, Policy
from extproc.policy.tenant_breakers import TenantBreakers
from extproc.policy.watermark import WatermarkController


def breaker(s: BreakerSettings, now: float) -> Breaker:
    return Breaker(s.config(), now)


def tenant_breakers(s: BreakerSettings, now: float) -> TenantBreakers:
    return TenantBreakers(s.config(), s.min_failing_tenants, s.max_tenant_breakers, now)


def watermark_controller(b: Backend) -> WatermarkController:
    w = b.watermark
    return WatermarkController(high=w.high, low=w.low, floor=w.floor, alpha=w.smoothing,
                               recover_per_s=w.recover_per_s, stale_after_s=w.stale_after_s,
                               waiting_threshold=w.waiting_threshold)


def adaptive_config(spec: Backend, policy: Policy) -> AdaptiveConfig | None:
    """The latency controller's settings for a backend, or None where no tier sets an SLO."""
    a = spec.adaptive_concurrency
    if not a.enabled or not any(t.ttft_p99_ms or t.itl_p99_ms for t in policy.tiers.values()):
        return None
    return AdaptiveConfig(ceiling=spec.max_concurrency, floor=min(a.floor, spec.max_concurrency),
                          window_s=a.window_s, min_samples=a.min_samples, quantile=a.quantile,
                          tolerance=a.tolerance, smoothing=a.smoothing, min_gradient=a.min_gradient,
                          risk_hold_s=a.risk_hold_s)
