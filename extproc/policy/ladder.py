"""The degradation ladder for one request: where it goes and how degraded, or why not.

``decide(LadderInput) -> Proceed | Fallback | Refuse``, on what the breakers said
(``extproc.request.admission.Admission.route`` asks them: asking takes a half-open probe's
place, which the adapter gives back when the request will not be sent). In order:

1. breaker: the backend's, then the model route's. Refused: the model's fallback if
   it has one whose breaker is not open (``Fallback``, no other rung applies), else
   ``breaker_open`` (Retry-After from the breaker, 30 s without one).
2. tenant: the tenant's own breaker on that backend (``tenant_breaker_open``; no
   fallback: its requests are what fails).
3. shed below ``shed_below_scale`` (``overloaded``, Retry-After 5 s).
4. fallback below ``fallback_below_scale``, when the model has one (``Fallback``).
5. clamp ``max_tokens`` below ``clamp_below_scale``, when the completion is above it.

A ``Fallback`` is finished by ``land`` once the fallback backend's breaker (and then the
tenant's there) have been asked: refused, or on to the clamp rung (after a fallback for
pressure only). A rule in shadow mode (``breaker``, ``shed``, ``degrade``) does not act:
the rule is listed in ``shadowed`` each time it would have, for its metric (a shadowed
``degrade`` at the fallback rung counts whether or not the model has a fallback).

Pure: no I/O, no clock (the pressure scale is computed by the caller at ``now``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from extproc.policy.breaker import BreakerVerdict
from extproc.policy.model import Degrade
from extproc.policy.reasons import Reason

__all__ = [
    "AS_ASKED",
    "RULES",
    "Decision",
    "Fallback",
    "LadderInput",
    "Proceed",
    "Refuse",
    "asks_tenant",
    "decide",
    "land",
]

BREAKER, SHED, DEGRADE = "breaker", "shed", "degrade"
RULES = (BREAKER, SHED, DEGRADE)  # the shadowable rules the ladder reads
BREAKER_RETRY_S = 30.0  # Retry-After when a refusing breaker gives none
SHED_RETRY_S = 5.0


class LadderInput(NamedTuple):
    """What the ladder decides on (a tuple, like ``SlotRequest``: built once per request)."""

    tier: str
    backend: str
    model: str
    breaker: BreakerVerdict  # the backend's breaker; the route's when the backend's allowed and it refused
    route_refused: bool  # the refusal (if any) is the model route's breaker, not the backend's
    tenant: BreakerVerdict | None  # the tenant's breaker on ``backend``; None: not asked (``asks_tenant``)
    fallback_window: int | None  # the fallback model's context window; None: no fallback, or its breaker is open
    scale: float  # the tier's pressure scale on the backend (extproc.policy.kv.pressure_scale)
    degrade: Degrade
    completion: int  # tokens reserved per completion, as requested
    shadowed: Collection[str] = ()  # the rules of ``RULES`` in shadow mode for this tier


@dataclass(frozen=True, slots=True)
class Proceed:
    """Send the request (to the fallback model if ``fallback``), reserving ``completion``
    (None: as asked). Undegraded and unshadowed it is ``AS_ASKED``: the usual answer
    allocates nothing on the hot path."""

    completion: int | None = None
    degraded: tuple[str, ...] = ()  # "fallback", "max_tokens", in the order applied
    shadowed: tuple[str, ...] = ()  # shadowed rules that would have acted, once per rung

    @property
    def fallback(self) -> bool:
        return "fallback" in self.degraded


AS_ASKED = Proceed()


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: Reason
    message: str
    code: str
    retry_after_s: float
    shadowed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Fallback:
    """Go to the fallback model: ask its backend's breaker (and, allowed, the tenant's there),
    then ``land``. The primary's probe places go back first."""

    inp: LadderInput
    completion: int  # the completion, capped at half the fallback's context window
    for_pressure: bool  # taken by the fallback rung (the clamp rung follows), not for an open breaker
    shadowed: tuple[str, ...] = ()


Decision = Proceed | Fallback | Refuse


def asks_tenant(breaker: BreakerVerdict, has_fallback: bool, shadowed: Collection[str]) -> bool:
    """Whether the ladder reads the tenant's breaker on the primary backend: it passed the
    breaker rung there (allowed, or refused in shadow mode with no fallback to take)."""
    return breaker.allowed or (not has_fallback and BREAKER in shadowed)


def decide(inp: LadderInput) -> Decision:
    hits: tuple[str, ...] = ()
    v = inp.breaker
    if not v.allowed:
        if inp.fallback_window is not None:
            return _fallback(inp, False, hits)
        if BREAKER not in inp.shadowed:
            what = (
                f"Model {inp.model!r} on backend {inp.backend!r}" if inp.route_refused else f"Backend {inp.backend!r}"
            )
            return Refuse(
                Reason.BREAKER_OPEN,
                f"{what} is unavailable ({v.reason}); retry later.",
                "service_unavailable",
                _retry(v),
                (),
            )
        hits = (BREAKER,)
    t = inp.tenant
    if t is not None and not t.allowed:
        if BREAKER not in inp.shadowed:
            return _tenant_refused(t, inp.backend, hits)
        hits = (*hits, BREAKER)
    d, scale = inp.degrade, inp.scale
    if d.shed_below_scale and scale < d.shed_below_scale:
        if SHED not in inp.shadowed:
            return Refuse(Reason.OVERLOADED, f"The backend is under memory pressure; the {inp.tier!r} tier is "
                          "shed first. Retry later.", "overloaded", SHED_RETRY_S, hits)
        hits = (*hits, SHED)
    if d.fallback_below_scale and scale < d.fallback_below_scale:
        if DEGRADE in inp.shadowed:
            hits = (*hits, DEGRADE)
        elif inp.fallback_window is not None:
            return _fallback(inp, True, hits)
    if not d.clamp_max_tokens and not hits:
        return AS_ASKED  # the usual answer, without the clamp rung's call
    return _clamp(inp, None, (), hits)


def land(step: Fallback, backend: str, breaker: BreakerVerdict, tenant: BreakerVerdict | None) -> Proceed | Refuse:
    """Finish a ``Fallback`` on what the fallback ``backend``'s breaker and (when it allowed)
    the tenant's breaker there said."""
    hits = step.shadowed
    if not breaker.allowed:
        return Refuse(Reason.BREAKER_OPEN, "The model and its fallback are unavailable; retry later.",
                      "service_unavailable", breaker.retry_after_s or BREAKER_RETRY_S, hits)
    if tenant is not None and not tenant.allowed:
        if BREAKER not in step.inp.shadowed:
            return _tenant_refused(tenant, backend, hits)
        hits = (*hits, BREAKER)
    if not step.for_pressure:
        return Proceed(step.completion, ("fallback",), hits)
    return _clamp(step.inp, step.completion, ("fallback",), hits)


def _fallback(inp: LadderInput, for_pressure: bool, hits: tuple[str, ...]) -> Fallback:
    assert inp.fallback_window is not None
    return Fallback(inp, min(inp.completion, max(1, inp.fallback_window // 2)), for_pressure, hits)


def _tenant_refused(v: BreakerVerdict, backend: str, hits: tuple[str, ...]) -> Refuse:
    return Refuse(Reason.TENANT_BREAKER_OPEN, f"Requests with this key are failing on backend {backend!r} "
                  f"while other tenants' requests succeed; the key is refused there for now ({v.reason}). "
                  "Retry later.", "service_unavailable", _retry(v), hits)


def _clamp(inp: LadderInput, completion: int | None, degraded: tuple[str, ...], hits: tuple[str, ...]) -> Proceed:
    """The last rung; ``completion`` None: as asked (then nothing was degraded yet)."""
    d = inp.degrade
    if d.clamp_max_tokens and inp.scale < d.clamp_below_scale \
            and (inp.completion if completion is None else completion) > d.clamp_max_tokens:
        if DEGRADE in inp.shadowed:
            hits = (*hits, DEGRADE)
        else:
            completion, degraded = d.clamp_max_tokens, (*degraded, "max_tokens")
    if completion is None and not hits:
        return AS_ASKED
    return Proceed(completion, degraded, hits)


def _retry(v: BreakerVerdict) -> float:
    return v.retry_after_s if v.retry_after_s is not None else BREAKER_RETRY_S
