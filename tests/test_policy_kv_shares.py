"""KV shares per tier (extproc.policy.kv_shares) through kv_fits and decide: a table and properties.

The view is a frozen BackendSnapshot; a tier is active when it reserves, waits, or is
named in ``active``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.admit import SlotRequest, decide
from extproc.policy.decision import Admit
from extproc.policy.kv import kv_fits
from extproc.policy.kv_shares import (
    DEMAND_HOLD_S,
    KvShare,
    reserved_for_others,
    share_denial,
    tier_active,
)
from extproc.policy.view import BackendSnapshot

PRIO = {"hi": 10, "mid": 5, "lo": 1}
SHARES = {"hi": KvShare(0.4), "mid": KvShare(0.2, burst=0.3)}
BASE = BackendSnapshot(kv_capacity=1000, priorities=PRIO, slots_total=64, kv_shares=SHARES)


def fits(view: BackendSnapshot, tier: str, kv: int) -> bool:
    return kv_fits(view, kv, 0.0, tier)


CASES = [
    ("idle tiers lend their guarantee", BASE, "lo", 1000, True),
    (
        "an active tier keeps its unused guarantee",
        replace(BASE, active=frozenset({"hi"})),
        "lo",
        601,
        False,
    ),
    ("up to the rest of the budget", replace(BASE, active=frozenset({"hi"})), "lo", 600, True),
    (
        "a guarantee in use is not reserved twice",
        replace(BASE, kv_in_use=300, kv_by_tier={"hi": 300}),
        "lo",
        600,
        True,
    ),
    (
        "the unused part still is",
        replace(BASE, kv_in_use=300, kv_by_tier={"hi": 300}),
        "lo",
        601,
        False,
    ),
    (
        "a tier is not held to its own guarantee",
        replace(BASE, active=frozenset({"hi"})),
        "hi",
        1000,
        True,
    ),
    (
        "two active tiers keep both",
        replace(BASE, active=frozenset({"hi", "mid"})),
        "lo",
        401,
        False,
    ),
    (
        "higher tiers keep a lower tier's guarantee too",
        replace(BASE, active=frozenset({"mid"})),
        "hi",
        801,
        False,
    ),
    ("the burst cap: guarantee plus burst", BASE, "mid", 500, True),
    ("over the burst cap", BASE, "mid", 501, False),
    (
        "the burst cap counts what the tier holds",
        replace(BASE, kv_in_use=400, kv_by_tier={"mid": 400}),
        "mid",
        101,
        False,
    ),
    (
        "a lone request is judged against the whole cache",
        replace(BASE, watermark_scale=0.5, active=frozenset({"hi"})),
        "lo",
        600,
        True,
    ),
    (
        "but still leaves the guarantees",
        replace(BASE, watermark_scale=0.5, active=frozenset({"hi"})),
        "lo",
        601,
        False,
    ),
]


@pytest.mark.parametrize(
    ("view", "tier", "kv", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_shares_table(view: BackendSnapshot, tier: str, kv: int, expected: bool) -> None:
    assert fits(view, tier, kv) is expected


def test_decide_queues_a_request_that_would_take_a_guarantee() -> None:
    view = replace(BASE, active=frozenset({"hi"}), kv_in_use=500, kv_by_tier={"lo": 500})
    assert isinstance(decide(view, SlotRequest("lo", "t", None, 100), 0.0), Admit)
    d = decide(view, SlotRequest("lo", "t", None, 101), 0.0)
    assert not isinstance(d, Admit) and d.cause == "kv_exhausted"
    assert isinstance(decide(view, SlotRequest("hi", "t", None, 500), 0.0), Admit)


def test_demand_is_held_for_a_while_after_the_last_request() -> None:
    assert tier_active(0, 0, 10.0, 10.0 + DEMAND_HOLD_S - 0.01)
    assert not tier_active(0, 0, 10.0, 10.0 + DEMAND_HOLD_S)
    assert not tier_active(0, 0, None, 10.0)
    assert tier_active(1, 0, None, 10.0) and tier_active(0, 1, None, 10.0)


def test_fractions_are_checked() -> None:
    with pytest.raises(ValueError):
        KvShare(1.5)
    with pytest.raises(ValueError):
        KvShare(0.2, burst=-0.1)


# -- properties --------------------------------------------------------------------------
TIERS = ("hi", "mid", "lo")
shares_st = st.fixed_dictionaries(
    {
        "hi": st.builds(KvShare, st.sampled_from([0.0, 0.1, 0.3, 0.5])),
        "mid": st.builds(KvShare, st.sampled_from([0.0, 0.2]), st.sampled_from([None, 0.1, 0.4])),
        "lo": st.builds(KvShare, st.just(0.0), st.sampled_from([None, 0.3])),
    }
)
arrivals = st.lists(st.tuples(st.sampled_from(TIERS), st.integers(1, 600)), max_size=40)


def admit_all(
    shares: dict[str, KvShare], reqs: list[tuple[str, int]], active: frozenset[str], cap: int = 1000
) -> BackendSnapshot:
    view = BackendSnapshot(kv_capacity=cap, priorities=PRIO, kv_shares=shares, active=active)
    for tier, kv in reqs:
        if kv_fits(view, kv, 0.0, tier):
            held = dict(view.kv_by_tier)
            held[tier] = held.get(tier, 0) + kv
            view = replace(view, kv_in_use=view.kv_in_use + kv, kv_by_tier=held)
            check(view, tier)
    return view


def check(view: BackendSnapshot, admitted: str) -> None:
    cap = view.kv_capacity
    assert cap is not None
    assert view.kv_in_use <= cap  # the budget holds (scale 1, no overcommit)
    for t, s in view.kv_shares.items():
        if t != admitted and t in view.active:
            # nobody else ate into an active tier's unused guarantee
            assert (
                view.kv_in_use + max(0.0, s.guaranteed * cap - view.kv_by_tier.get(t, 0))
                <= cap + 1e-9
            )
    s = view.kv_shares.get(admitted)
    if s is not None and s.burst is not None:
        assert view.kv_by_tier.get(admitted, 0) <= (s.guaranteed + s.burst) * cap + 1e-9


@settings(max_examples=300, deadline=None)
@given(shares_st, arrivals, st.frozensets(st.sampled_from(TIERS)))
def test_no_admission_takes_an_active_tiers_guarantee_or_passes_a_burst_cap(
    shares: dict[str, KvShare], reqs: list[tuple[str, int]], active: frozenset[str]
) -> None:
    # ``active`` tiers are active from the start, so their guarantee is kept before they reserve.
    admit_all(shares, reqs, active | {t for t, _ in reqs[:1]})


@settings(max_examples=300, deadline=None)
@given(shares_st, st.sampled_from(TIERS), st.integers(0, 1000), st.integers(1, 1000))
def test_without_other_demand_shares_change_nothing_but_the_burst_cap(
    shares: dict[str, KvShare], tier: str, in_use: int, kv: int
) -> None:
    with_shares = BackendSnapshot(
        kv_capacity=1000,
        priorities=PRIO,
        kv_shares=shares,
        kv_in_use=in_use,
        kv_by_tier={tier: in_use} if in_use else {},
    )
    plain = replace(with_shares, kv_shares={})
    s = shares[tier]
    capped = s.burst is not None and in_use + kv > (s.guaranteed + s.burst) * 1000
    assert kv_fits(with_shares, kv, 0.0, tier) == (kv_fits(plain, kv, 0.0, tier) and not capped)


@settings(max_examples=200, deadline=None)
@given(
    shares_st, st.dictionaries(st.sampled_from(TIERS), st.integers(0, 500)), st.sampled_from(TIERS)
)
def test_reserved_is_the_other_active_tiers_unused_guarantee(
    shares: dict[str, KvShare], held: dict[str, int], tier: str
) -> None:
    active = {t: True for t in TIERS}
    got = reserved_for_others(shares, held, active, 1000.0, tier)
    assert got == pytest.approx(
        sum(max(0.0, shares[t].guaranteed * 1000 - held.get(t, 0)) for t in TIERS if t != tier)
    )
    assert (
        share_denial(shares, held, {t: False for t in TIERS}, 1000.0, 0, tier, 1) is None
        or shares[tier].burst is not None
    )


# -- the policy schema -------------------------------------------------------------------
def policy_doc(**tiers: dict[str, object]) -> dict[str, object]:
    return {
        "backends": [
            {
                "name": "b",
                "address": "127.0.0.1:1",
                "engine_priority": "vllm",
                "models": [{"name": "m", "context_window": 64}],
            }
        ],
        "tiers": {name: {"tpm": 10, "rpm": 1, **t} for name, t in tiers.items()},
        "tenants": [],
    }


def test_the_schema_reads_kv_shares_revocable_and_engine_priority() -> None:
    from extproc.policy.schema import build_policy

    p = build_policy(
        policy_doc(
            premium={"priority": 100, "kv_guaranteed": 0.5, "kv_burst": 0.25},
            batch={"revocable": True},
        )
    )
    t, b = p.tiers["premium"], p.tiers["batch"]
    assert (t.kv_guaranteed, t.kv_burst, t.revocable) == (0.5, 0.25, False)
    assert (b.kv_guaranteed, b.kv_burst, b.revocable) == (0.0, None, True)
    be = p.backends[0]
    from dataclasses import replace as dc_replace

    from extproc.request.upstream import engine_priority

    assert be.engine_priority == "vllm" and engine_priority(be, 100) == -100
    assert engine_priority(dc_replace(be, engine_priority="sglang"), 100) == 100
    assert engine_priority(dc_replace(be, engine_priority="off"), 100) is None


@pytest.mark.parametrize(
    ("tiers", "says"),
    [
        ({"a": {"kv_guaranteed": 0.7}, "b": {"kv_guaranteed": 0.4}}, "add up to 1.1"),
        ({"a": {"kv_guaranteed": 1.5}}, "in [0, 1]"),
        ({"a": {"kv_burst": -0.1}}, "in [0, 1]"),
        ({"a": {"revocable": "yes"}}, "revocable"),
    ],
)
def test_the_schema_refuses_bad_shares(tiers: dict[str, dict[str, object]], says: str) -> None:
    from extproc.policy.schema import PolicyError, build_policy

    with pytest.raises(PolicyError) as exc:
        build_policy(policy_doc(**tiers))
    assert says in str(exc.value)
