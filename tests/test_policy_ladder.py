"""The degradation ladder (extproc.policy.ladder): a table of cases, then properties.

Each case runs ``decide`` and, for a ``Fallback``, ``land`` on what the fallback's
breakers say, the way ``Admission.route`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.policy import ladder
from extproc.policy.breaker import BreakerState, BreakerVerdict
from extproc.policy.ladder import Fallback, LadderInput, Proceed, Refuse, asks_tenant, decide, land
from extproc.policy.schema import Degrade

OK = BreakerVerdict(True, BreakerState.CLOSED)
OPEN = BreakerVerdict(False, BreakerState.OPEN, "open", 12.0)
THROTTLED = BreakerVerdict(False, BreakerState.HALF_OPEN, "half_open_throttle", None)
NO_WAIT = BreakerVerdict(False, BreakerState.OPEN, "open", 0.0)
TENANT_OPEN = BreakerVerdict(False, BreakerState.OPEN, "tenant_failures", 7.0)
LADDER = Degrade(clamp_max_tokens=256, clamp_below_scale=0.9, fallback_below_scale=0.8, shed_below_scale=0.7)
NONE = Degrade()


def inp(scale: float = 1.0, completion: int = 1000, *, breaker: BreakerVerdict = OK, route_refused: bool = False,
        tenant: BreakerVerdict | None = OK, fallback: int | None = None, degrade: Degrade = LADDER,
        shadow: tuple[str, ...] = ()) -> LadderInput:
    return LadderInput("free", "b", "m", breaker, route_refused, tenant, fallback, scale, degrade, completion, shadow)


def run(i: LadderInput, fb_breaker: BreakerVerdict = OK, fb_tenant: BreakerVerdict = OK) -> Proceed | Refuse:
    got = decide(i)
    if isinstance(got, Fallback):
        got = land(got, "fb", fb_breaker, fb_tenant if fb_breaker.allowed else None)
    return got


def summary(d: Proceed | Refuse, asked: int) -> tuple[Any, ...]:
    if isinstance(d, Proceed):
        return ("proceed", asked if d.completion is None else d.completion, d.degraded, d.fallback, d.shadowed)
    return ("refuse", d.reason, d.retry_after_s, d.shadowed)


FB = 2048  # a fallback model whose half window (1024) is above the request's 1000
CASES: list[tuple[str, LadderInput, dict[str, BreakerVerdict], tuple[Any, ...]]] = [
    # no pressure, no breaker: as asked
    ("idle", inp(), {}, ("proceed", 1000, (), False, ())),
    ("no ladder configured, any pressure", inp(0.1, degrade=NONE, fallback=FB), {}, ("proceed", 1000, (), False, ())),
    # clamp
    ("clamp below its scale", inp(0.85), {}, ("proceed", 256, ("max_tokens",), False, ())),
    ("no clamp at its scale", inp(0.9), {}, ("proceed", 1000, (), False, ())),
    ("clamp only a completion above it", inp(0.85, 200), {}, ("proceed", 200, (), False, ())),
    ("clamp not a completion equal to it", inp(0.85, 256), {}, ("proceed", 256, (), False, ())),
    ("clamp shadowed", inp(0.85, shadow=("degrade",)), {}, ("proceed", 1000, (), False, ("degrade",))),
    ("clamp shadowed but not due", inp(0.85, 200, shadow=("degrade",)), {}, ("proceed", 200, (), False, ())),
    # fallback for pressure
    ("fallback below its scale, then clamp", inp(0.75, fallback=FB), {},
     ("proceed", 256, ("fallback", "max_tokens"), True, ())),
    ("fallback caps the completion at half its window", inp(0.75, fallback=300), {},
     ("proceed", 150, ("fallback",), True, ())),
    ("fallback below its scale, no fallback model: clamp only", inp(0.75), {},
     ("proceed", 256, ("max_tokens",), False, ())),
    ("fallback shadowed: both degrade rungs counted", inp(0.75, fallback=FB, shadow=("degrade",)), {},
     ("proceed", 1000, (), False, ("degrade", "degrade"))),
    ("fallback shadowed counts without a fallback model", inp(0.75, shadow=("degrade",)), {},
     ("proceed", 1000, (), False, ("degrade", "degrade"))),
    ("pressure fallback, its breaker refuses", inp(0.75, fallback=FB), {"fb_breaker": OPEN},
     ("refuse", "breaker_open", 12.0, ())),
    ("pressure fallback, the tenant refused there", inp(0.75, fallback=FB), {"fb_tenant": TENANT_OPEN},
     ("refuse", "tenant_breaker_open", 7.0, ())),
    ("pressure fallback, the tenant refused there in shadow", inp(0.75, fallback=FB, shadow=("breaker",)),
     {"fb_tenant": TENANT_OPEN}, ("proceed", 256, ("fallback", "max_tokens"), True, ("breaker",))),
    # shed
    ("shed below its scale", inp(0.6), {}, ("refuse", "overloaded", 5.0, ())),
    ("shed before fallback", inp(0.6, fallback=FB), {}, ("refuse", "overloaded", 5.0, ())),
    ("shed shadowed: on to fallback and clamp", inp(0.6, fallback=FB, shadow=("shed",)), {},
     ("proceed", 256, ("fallback", "max_tokens"), True, ("shed",))),
    ("shed and degrade shadowed", inp(0.6, shadow=("shed", "degrade")), {},
     ("proceed", 1000, (), False, ("shed", "degrade", "degrade"))),
    # the primary's breakers
    ("backend breaker open", inp(breaker=OPEN), {}, ("refuse", "breaker_open", 12.0, ())),
    ("half-open throttle without a wait: 30 s", inp(breaker=THROTTLED), {}, ("refuse", "breaker_open", 30.0, ())),
    ("an open breaker's zero wait is kept", inp(breaker=NO_WAIT), {}, ("refuse", "breaker_open", 0.0, ())),
    ("breaker open, to the fallback: no other rung", inp(0.6, breaker=OPEN, tenant=None, fallback=FB), {},
     ("proceed", 1000, ("fallback",), True, ())),
    ("breaker open, to the fallback, capped", inp(breaker=OPEN, tenant=None, fallback=300), {},
     ("proceed", 150, ("fallback",), True, ())),
    ("breaker open and the fallback's too", inp(breaker=OPEN, tenant=None, fallback=FB), {"fb_breaker": OPEN},
     ("refuse", "breaker_open", 12.0, ())),
    ("the fallback's zero wait is 30 s", inp(breaker=OPEN, tenant=None, fallback=FB), {"fb_breaker": NO_WAIT},
     ("refuse", "breaker_open", 30.0, ())),
    ("breaker open, the tenant refused on the fallback", inp(breaker=OPEN, tenant=None, fallback=FB),
     {"fb_tenant": TENANT_OPEN}, ("refuse", "tenant_breaker_open", 7.0, ())),
    ("breaker shadowed: the ladder goes on", inp(0.85, breaker=OPEN, shadow=("breaker",)), {},
     ("proceed", 256, ("max_tokens",), False, ("breaker",))),
    ("breaker shadowed with a fallback: the fallback", inp(breaker=OPEN, tenant=None, fallback=FB,
                                                         shadow=("breaker",)), {},
     ("proceed", 1000, ("fallback",), True, ())),
    # the tenant's breaker
    ("tenant refused", inp(tenant=TENANT_OPEN), {}, ("refuse", "tenant_breaker_open", 7.0, ())),
    ("tenant refused before shed", inp(0.6, tenant=TENANT_OPEN), {}, ("refuse", "tenant_breaker_open", 7.0, ())),
    ("tenant refused in shadow: on to shed", inp(0.6, tenant=TENANT_OPEN, shadow=("breaker",)), {},
     ("refuse", "overloaded", 5.0, ("breaker",))),
    ("breaker and tenant shadowed: both counted", inp(breaker=OPEN, tenant=TENANT_OPEN, shadow=("breaker",)), {},
     ("proceed", 1000, (), False, ("breaker", "breaker"))),
]


@pytest.mark.parametrize(("name", "i", "fb", "want"), CASES, ids=[c[0] for c in CASES])
def test_ladder(name: str, i: LadderInput, fb: dict[str, BreakerVerdict], want: tuple[Any, ...]) -> None:
    assert summary(run(i, **fb), i.completion) == want


def test_messages_name_what_refused() -> None:
    backend = decide(inp(breaker=OPEN))
    route = decide(inp(breaker=OPEN, route_refused=True))
    assert isinstance(backend, Refuse) and isinstance(route, Refuse)
    assert backend.message == "Backend 'b' is unavailable (open); retry later."
    assert route.message == "Model 'm' on backend 'b' is unavailable (open); retry later."
    assert backend.code == route.code == "service_unavailable"
    shed = decide(inp(0.6))
    assert isinstance(shed, Refuse) and shed.code == "overloaded" and "'free' tier is shed first" in shed.message
    tenant = run(inp(breaker=OPEN, tenant=None, fallback=FB), fb_tenant=TENANT_OPEN)
    assert isinstance(tenant, Refuse) and "on backend 'fb'" in tenant.message and "(tenant_failures)" in tenant.message
    both = run(inp(breaker=OPEN, tenant=None, fallback=FB), fb_breaker=OPEN)
    assert isinstance(both, Refuse) and both.message == "The model and its fallback are unavailable; retry later."


def test_the_usual_answer_allocates_nothing() -> None:
    assert decide(inp()) is ladder.AS_ASKED
    assert decide(inp(0.85, 200)) is ladder.AS_ASKED  # a clamp that is not due
    assert decide(inp(0.85)) == Proceed(256, ("max_tokens",))


def test_the_breaker_rung_ends_at_a_fallback_and_the_pressure_rung_goes_on_to_clamp() -> None:
    for_breaker = decide(inp(0.6, breaker=OPEN, tenant=None, fallback=FB))
    for_pressure = decide(inp(0.75, fallback=FB))
    assert isinstance(for_breaker, Fallback) and not for_breaker.for_pressure
    assert isinstance(for_pressure, Fallback) and for_pressure.for_pressure


@pytest.mark.parametrize(("breaker", "has_fallback", "shadow", "want"), [
    (OK, False, (), True),
    (OK, True, (), True),
    (OPEN, True, (), False),  # to the fallback: the tenant is asked there
    (OPEN, False, (), False),  # refused before the tenant
    (OPEN, False, ("breaker",), True),  # shadowed: the ladder goes on
    (OPEN, True, ("breaker",), False),  # a fallback comes before the shadow
])
def test_asks_tenant(breaker: BreakerVerdict, has_fallback: bool, shadow: tuple[str, ...], want: bool) -> None:
    assert asks_tenant(breaker, has_fallback, shadow) is want
    # The ladder reads the tenant's verdict exactly when it said it would ask for it.
    i = inp(breaker=breaker, tenant=TENANT_OPEN if want else None, fallback=FB if has_fallback else None,
            shadow=shadow)
    got = decide(i)
    if not want:
        assert isinstance(got, Fallback) or (isinstance(got, Refuse) and got.reason == "breaker_open")
    elif shadow:
        assert isinstance(got, Proceed) and got.shadowed == ("breaker", "breaker")
    else:
        assert isinstance(got, Refuse) and got.reason == "tenant_breaker_open"


# -- properties ------------------------------------------------------------------------
scales = st.floats(0.0, 1.0)
degrades = st.builds(Degrade, clamp_max_tokens=st.integers(0, 2000), clamp_below_scale=scales,
                     fallback_below_scale=scales, shed_below_scale=scales)
shadows = st.sets(st.sampled_from(ladder.RULES)).map(tuple)


@given(a=scales, b=scales, d=degrades, completion=st.integers(1, 4000),
       fallback=st.one_of(st.none(), st.integers(2, 8000)), shadow=shadows)
def test_a_lower_scale_never_degrades_less(a: float, b: float, d: Degrade, completion: int, fallback: int | None,
                                           shadow: tuple[str, ...]) -> None:
    """At a lower scale: refused, or a completion no larger and a fallback not undone."""
    lo, hi = sorted((a, b))
    i = inp(hi, completion, fallback=fallback, degrade=d, shadow=shadow)
    at_hi, at_lo = run(i), run(i._replace(scale=lo))
    if isinstance(at_lo, Refuse):
        return
    assert isinstance(at_hi, Proceed)
    lo_c, hi_c = (completion if c is None else c for c in (at_lo.completion, at_hi.completion))
    assert lo_c <= hi_c <= completion
    assert at_lo.fallback >= at_hi.fallback


@given(scale=scales, d=degrades, completion=st.integers(1, 4000),
       breaker=st.sampled_from([OK, OPEN, THROTTLED]), tenant=st.sampled_from([OK, TENANT_OPEN]))
def test_a_fully_shadowed_ladder_sends_the_request_as_asked(scale: float, d: Degrade, completion: int,
                                                           breaker: BreakerVerdict,
                                                           tenant: BreakerVerdict) -> None:
    got = run(inp(scale, completion, breaker=breaker, tenant=tenant, degrade=d, shadow=ladder.RULES))
    assert isinstance(got, Proceed)
    assert (got.completion, got.degraded, got.fallback) == (None, (), False)  # as asked
    would_have = [r for r in got.shadowed if r != "breaker"]
    assert len(got.shadowed) - len(would_have) == (not breaker.allowed) + (not tenant.allowed)
