"""Per-tenant TPM/RPM admission with pre-charge and settle: the state seam.

``LocalState`` keeps every tenant's buckets in this process. A shared store for
many replicas implements the same methods (``admit``, ``peek``, ``spend``, ``settle``,
``view``, ``reconfigure``) atomically on its side; nothing above this seam changes.
Pure: callers pass ``now``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from extproc.policy.bucket import Ledger, TokenBucket
from extproc.policy.reasons import Reason
from extproc.policy.schema import Limits


# NamedTuples, not frozen dataclasses: two of each are made per request, at half the cost.
class RateView(NamedTuple):
    limit: int
    remaining: int
    reset_s: float


class Verdict(NamedTuple):
    admitted: bool
    tokens: RateView
    requests: RateView
    reason: Reason | None = None
    message: str = ""
    retry_after_s: float = 0.0


class _TenantBuckets:
    __slots__ = ("tpm", "rpm", "limits", "scale")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.scale = 1.0
        self.tpm = TokenBucket(limits.burst_tokens, limits.tpm / 60.0, now)
        self.rpm = TokenBucket(limits.rpm, limits.rpm / 60.0, now)

    def apply(self, limits: Limits, scale: float | None, now: float) -> None:
        """New limits (policy change) or a new watermark scale; None keeps the scale.

        The KV watermark scales TPM, the budget that fills the cache (RPM is not
        memory): the refill rate drops with the scale, and ``headroom`` keeps the
        top (1 - scale) of the bucket out of reach. The bucket's capacity itself is
        not cut, so tokens a tenant saved are not destroyed by a passing spike.
        """
        scale = self.scale if scale is None else scale
        if limits != self.limits or scale != self.scale:
            self.limits, self.scale = limits, scale
            self.tpm.reconfigure(limits.burst_tokens, limits.tpm * scale / 60.0, now)
            self.rpm.reconfigure(limits.rpm, limits.rpm / 60.0, now)

    @property
    def headroom(self) -> float:
        return (1.0 - self.scale) * self.tpm.capacity


def _view(bucket: TokenBucket, limit: int, now: float) -> RateView:
    level = bucket.remaining(now)
    return RateView(limit, max(0, math.floor(level)), bucket.refill_s(level))


class LocalState:
    def __init__(self) -> None:
        self._tenants: dict[str, _TenantBuckets] = {}
        self.ledger = Ledger()
        self.in_flight = 0

    def _buckets(self, tenant: str, limits: Limits, now: float, scale: float | None = None) -> _TenantBuckets:
        b = self._tenants.get(tenant)
        if b is None:
            b = self._tenants[tenant] = _TenantBuckets(limits, now)
        b.apply(limits, scale, now)
        return b

    def view(self, tenant: str, limits: Limits, now: float) -> tuple[RateView, RateView]:
        b = self._buckets(tenant, limits, now)
        return _view(b.tpm, limits.tpm, now), _view(b.rpm, limits.rpm, now)

    def admit(self, tenant: str, limits: Limits, cost: int, now: float, scale: float | None = None,
              force: bool = False) -> Verdict:
        """Charge 1 request and ``cost`` tokens together, or neither.

        ``force`` charges even past the budget (into debt): a rule in shadow mode
        still keeps honest books, so turning it on later starts from the truth.
        """
        b = self._buckets(tenant, limits, now, scale)
        if force:
            b.rpm.settle(0, 1, now)
            b.tpm.settle(0, cost, now)
            return self._admitted(b, limits, cost, now)
        refused = self._refusal(b, limits, cost, now)
        if refused is not None:
            return refused
        b.rpm.try_charge(1, now)
        b.tpm.try_charge(cost, now)
        return self._admitted(b, limits, cost, now)

    def peek(self, tenant: str, limits: Limits, cost: int, now: float) -> Verdict:
        """What ``admit`` would say for ``cost``, charging nothing (a refusal before any work)."""
        b = self._buckets(tenant, limits, now)
        refused = self._refusal(b, limits, cost, now)
        if refused is not None:
            return refused
        return Verdict(True, _view(b.tpm, limits.tpm, now), _view(b.rpm, limits.rpm, now))

    def spend(self, tenant: str, limits: Limits, tokens: int, now: float) -> None:
        """Charge ``tokens`` as used, without a request: the work done on a refused prompt.

        May leave the bucket in debt. In the ledger it is a pre-charge settled at once.
        """
        b = self._buckets(tenant, limits, now)
        b.tpm.settle(0, tokens, now)
        self.ledger.record_precharge(tokens)
        self.ledger.record_settle(tokens, tokens)

    def _refusal(self, b: _TenantBuckets, limits: Limits, cost: int, now: float) -> Verdict | None:
        if cost > b.tpm.capacity:
            tv, rv = _view(b.tpm, limits.tpm, now), _view(b.rpm, limits.rpm, now)
            return Verdict(False, tv, rv, Reason.TPM_REQUEST_TOO_LARGE,
                           f"Request needs {cost} tokens, more than the {int(b.tpm.capacity)} this key may use "
                           "at once. Lower max_tokens or shorten the prompt.", math.inf)
        # Peek before charging so a request refused for tokens does not eat an RPM slot.
        need = min(b.tpm.capacity, cost + b.headroom)
        requests, tokens = b.rpm.remaining(now), b.tpm.remaining(now)
        if requests >= 1 and tokens >= need:
            return None
        # Short of one or the other, so at least one wait is positive.
        rpm_wait = max(0.0, 1 - requests) / max(b.rpm.rate_per_s, 1e-9)
        tpm_wait = max(0.0, need - tokens) / max(b.tpm.rate_per_s, 1e-9)
        tv, rv = _view(b.tpm, limits.tpm, now), _view(b.rpm, limits.rpm, now)
        if rpm_wait >= tpm_wait:
            return Verdict(False, tv, rv, Reason.RPM, f"Rate limit reached: {limits.rpm} requests per minute.",
                           rpm_wait)
        return Verdict(False, tv, rv, Reason.TPM,
                       f"Rate limit reached: {limits.tpm} tokens per minute; this request needs {cost}.", tpm_wait)

    def _admitted(self, b: _TenantBuckets, limits: Limits, cost: int, now: float) -> Verdict:
        self.ledger.record_precharge(cost)
        self.in_flight += 1
        return Verdict(True, _view(b.tpm, limits.tpm, now), _view(b.rpm, limits.rpm, now))

    def settle(self, tenant: str, reserved: int, actual: int, now: float) -> None:
        b = self._tenants.get(tenant)
        if b is not None:
            b.tpm.settle(reserved, actual, now)
        self.ledger.record_settle(reserved, actual)
        self.in_flight -= 1

    def forget(self, keep: set[str]) -> None:
        """Drop buckets of tenants no longer in the policy (in-flight ones settle harmlessly)."""
        for name in list(self._tenants):
            if name not in keep:
                del self._tenants[name]

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "in_flight": self.in_flight,
            "ledger": {"precharged": self.ledger.precharged, "charged": self.ledger.charged,
                       "refunded": self.ledger.refunded, "excess": self.ledger.excess,
                       "outstanding": self.ledger.outstanding, "balanced": self.ledger.balanced()},
            "buckets": {name: {"tokens": b.tpm.remaining(now), "requests": b.rpm.remaining(now)}
                        for name, b in self._tenants.items()},
        }
