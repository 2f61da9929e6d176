"""Revocation (extproc.policy.revoke): who gives room back, in order of least harm; when;
how much."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.kv_shares import KvShare
from extproc.policy.revoke import Need, Running, _freed, plan, shortfall, should_revoke
from extproc.policy.view import BackendSnapshot

PRIO = {"premium": 100, "free": 10, "batch": 0}
REVOCABLE = {"batch": True}
NO_SHARES: dict[str, KvShare] = {}
ALL_ACTIVE = {"premium": True, "free": True, "batch": True}


def run(
    i: int,
    tier: str,
    kv: int,
    producing: bool = False,
    waste: int = 0,
    at: float = 0.0,
    endpoint: str | None = None,
) -> Running:
    return Running(i, tier, kv, producing, waste, at, endpoint)


def ids(got: tuple[Running, ...]) -> list[int]:
    return [r.id for r in got]


def held_of(cands: list[Running]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in cands:
        out[r.tier] = out.get(r.tier, 0) + r.kv
    return out


def plan_for(
    cands: list[Running],
    need: Need,
    shares: dict[str, KvShare] = NO_SHARES,
    revocable: dict[str, bool] = REVOCABLE,
) -> list[int]:
    return ids(plan(cands, need, PRIO, revocable, shares, held_of(cands), ALL_ACTIVE, 1000.0))


def test_not_yet_producing_goes_before_producing() -> None:
    cands = [run(1, "batch", 300, producing=True), run(2, "batch", 300)]
    assert plan_for(cands, Need("premium", 200)) == [2]


def test_lowest_tier_first_then_least_waste_then_newest() -> None:
    cands = [
        run(1, "free", 300),
        run(2, "batch", 300, waste=50),
        run(3, "batch", 300, waste=10, at=1.0),
        run(4, "batch", 300, waste=10, at=2.0),
    ]
    assert plan_for(cands, Need("premium", 300)) == [4]
    assert plan_for(cands, Need("premium", 600)) == [4, 3]
    assert plan_for(cands, Need("premium", 1200)) == [4, 3, 2, 1]


def test_a_producing_request_of_a_tier_that_is_not_revocable_stays() -> None:
    cands = [run(1, "free", 500, producing=True), run(2, "batch", 100, producing=True)]
    assert plan_for(cands, Need("premium", 100)) == [2]
    assert (
        plan_for(cands, Need("premium", 200)) == []
    )  # the free stream may not be ended: nothing helps


def test_only_lower_tiers() -> None:
    cands = [run(1, "premium", 500), run(2, "free", 500)]
    assert plan_for(cands, Need("free", 100)) == []
    assert plan_for(cands, Need("premium", 100)) == [2]


def test_nothing_when_it_cannot_be_met() -> None:
    assert plan_for([run(1, "batch", 100), run(2, "batch", 100)], Need("premium", 300)) == []


def test_extra_victims_are_given_back() -> None:
    # Greedy takes the small one first, then the large; the large alone is enough.
    cands = [run(1, "batch", 100), run(2, "batch", 500, waste=5)]
    assert plan_for(cands, Need("premium", 450)) == [2]


def test_a_victims_guarantee_is_kept() -> None:
    shares = {"premium": KvShare(0.3), "free": KvShare(0.2)}
    cands = [run(1, "free", 150), run(2, "free", 150, at=1.0), run(3, "batch", 100)]
    # free holds 300 of its 200 guarantee: only 100 of it may be taken back.
    assert plan_for(cands, Need("premium", 200), shares) == [3, 2]
    assert plan_for(cands, Need("premium", 201), shares) == []


def test_on_a_pool_only_the_endpoint_counts() -> None:
    cands = [run(1, "batch", 500, endpoint="a"), run(2, "batch", 100, endpoint="b", at=1.0)]
    assert plan_for(cands, Need("premium", 200, endpoint="a")) == [1]
    assert plan_for(cands, Need("premium", 200, endpoint="b")) == []


def test_when_a_tier_may_take_room_back() -> None:
    shares = {"premium": KvShare(0.4), "free": KvShare(0.0, burst=0.5)}
    assert should_revoke(
        shares, {"premium": 100}, "premium", 300, 1000.0, slo_at_risk=False
    )  # within
    assert not should_revoke(shares, {"premium": 100}, "premium", 301, 1000.0, slo_at_risk=False)
    assert should_revoke(
        shares, {"premium": 100}, "premium", 301, 1000.0, slo_at_risk=True
    )  # burst, at risk
    assert not should_revoke(
        shares, {}, "free", 10, 1000.0, slo_at_risk=True
    )  # no guarantee: no right
    capped = {"premium": KvShare(0.4, burst=0.1)}
    assert not should_revoke(capped, {"premium": 450}, "premium", 100, 1000.0, slo_at_risk=True)


def test_shortfall_counts_the_guarantees_and_what_is_owed() -> None:
    view = BackendSnapshot(
        kv_capacity=1000,
        kv_in_use=800,
        priorities=PRIO,
        kv_shares={"free": KvShare(0.1)},
        kv_by_tier={"batch": 800},
        active=frozenset({"free"}),
    )
    assert shortfall(view, "premium", 150, 0.0) == 800 + 150 + 100 - 1000
    assert shortfall(replace(view, kv_in_use=0, kv_by_tier={}), "premium", 150, 0.0) == 0
    assert shortfall(replace(view, kv_capacity=None), "premium", 10**6, 0.0) == 0


# -- properties --------------------------------------------------------------------------
cand_st = st.builds(
    run,
    st.integers(0, 10**6),
    st.sampled_from(["free", "batch", "premium"]),
    st.integers(1, 400),
    st.booleans(),
    st.integers(0, 1000),
    st.floats(0, 100),
)
shares_st = st.fixed_dictionaries(
    {
        "free": st.builds(KvShare, st.sampled_from([0.0, 0.1, 0.3])),
        "batch": st.builds(KvShare, st.sampled_from([0.0, 0.2])),
    }
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(cand_st, max_size=12, unique_by=lambda r: r.id),
    st.integers(1, 2000),
    shares_st,
    st.sampled_from([{}, {"batch": True}, {"batch": True, "free": True}]),
)
def test_a_plan_meets_the_need_with_no_victim_to_spare(
    cands: list[Running], need_kv: int, shares: dict[str, KvShare], revocable: dict[str, bool]
) -> None:
    need = Need("premium", need_kv)
    held = held_of(cands)
    got = plan(cands, need, PRIO, revocable, shares, held, ALL_ACTIVE, 1000.0)
    eligible = [
        r
        for r in cands
        if PRIO[r.tier] < PRIO["premium"] and (not r.producing or revocable.get(r.tier))
    ]
    if not got:
        assert _freed(eligible, shares, held, ALL_ACTIVE, 1000.0) < need_kv
        return
    assert all(r in eligible for r in got)
    assert len({r.id for r in got}) == len(got)
    assert _freed(got, shares, held, ALL_ACTIVE, 1000.0) >= need_kv
    for r in got:  # minimal: each victim is needed
        assert _freed([x for x in got if x is not r], shares, held, ALL_ACTIVE, 1000.0) < need_kv


def test_a_waiters_slo_is_at_risk_once_it_waited_a_quarter_of_it() -> None:
    from extproc.policy.revoke import slo_at_risk

    assert slo_at_risk(True, 0.0, None)
    assert not slo_at_risk(False, 10.0, None)  # no SLO: only the controller can say
    assert not slo_at_risk(False, 0.37, 1500)
    assert slo_at_risk(False, 0.375, 1500)
