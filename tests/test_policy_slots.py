"""Slot pools: guaranteed per tier, burstable shared pool, tenant caps, watermark scaling."""

from __future__ import annotations

from collections import Counter
from dataclasses import FrozenInstanceError

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.slots import Denied, SlotGrant, SlotPool, SlotReleaseError

TIERS = ["premium", "standard", "free", "batch"]


def make_pool(**kw: object) -> SlotPool:
    # total 20: premium 6, standard 4, free 2, batch 0 guaranteed; shared 8
    args: dict = {
        "total": 20,
        "guaranteed": {"premium": 6, "standard": 4, "free": 2},
        "tier_order": TIERS,
    }
    args.update(kw)
    return SlotPool(**args)


def take(pool: SlotPool, tier: str, tenant: str, n: int, **kw: object) -> list[SlotGrant]:
    grants = []
    for _ in range(n):
        g = pool.try_acquire(tier, tenant, **kw)  # type: ignore[arg-type]
        assert isinstance(g, SlotGrant), g
        grants.append(g)
    return grants


# -- acquisition order and isolation -------------------------------------------------


def test_guaranteed_first_then_shared() -> None:
    pool = make_pool()
    grants = take(pool, "standard", "t1", 6)
    assert [g.pool for g in grants] == ["guaranteed"] * 4 + ["shared"] * 2
    usage = pool.in_use()
    assert usage.guaranteed["standard"] == 4 and usage.shared_by_tier["standard"] == 2
    assert usage.total == 6 and usage.shared == 2


def test_release_returns_slot_to_the_pool_it_came_from() -> None:
    pool = make_pool()
    grants = take(pool, "standard", "t1", 5)
    pool.release(grants[4])  # the shared one
    assert pool.in_use().shared == 0 and pool.in_use().guaranteed["standard"] == 4
    pool.release(grants[0])
    assert pool.in_use().guaranteed["standard"] == 3


def test_other_tiers_cannot_use_a_tiers_guaranteed_slots() -> None:
    pool = make_pool()
    take(pool, "batch", "b", 8)  # batch has no guarantee: fills the shared pool
    denied = pool.try_acquire("batch", "b")
    assert isinstance(denied, Denied) and denied.reason == "slots_exhausted"
    free_g = pool.try_acquire("standard", "s")  # standard still has its own slots
    assert isinstance(free_g, SlotGrant) and free_g.pool == "guaranteed"
    # premium's 6 guaranteed slots are idle, yet nobody else gets them
    take(pool, "standard", "s", 3)
    assert isinstance(pool.try_acquire("standard", "s"), Denied)
    assert isinstance(pool.try_acquire("free", "f"), SlotGrant)  # its own guarantee
    assert pool.in_use().guaranteed["premium"] == 0
    assert len(take(pool, "premium", "p", 6)) == 6


def test_burst_cap_limits_a_tiers_share_of_the_pool() -> None:
    pool = make_pool(burst_caps={"batch": 3})
    take(pool, "batch", "b", 3)
    denied = pool.try_acquire("batch", "b")
    assert isinstance(denied, Denied) and denied.reason == "slots_exhausted"
    assert "burst cap" in denied.detail
    assert len(take(pool, "standard", "s", 9)) == 9  # 4 guaranteed + remaining 5 shared


def test_tenant_cap_holds_across_tiers() -> None:
    pool = make_pool()
    take(pool, "premium", "acme", 2, tenant_cap=3)
    take(pool, "standard", "acme", 1, tenant_cap=3)
    denied = pool.try_acquire("premium", "acme", tenant_cap=3)
    assert isinstance(denied, Denied) and denied.reason == "slots_tenant_cap"
    assert isinstance(pool.try_acquire("premium", "other", tenant_cap=3), SlotGrant)
    assert pool.in_use().by_tenant == {"acme": 3, "other": 1}


def test_tenant_cap_zero_denies_and_none_means_uncapped() -> None:
    pool = make_pool()
    assert isinstance(pool.try_acquire("free", "x", tenant_cap=0), Denied)
    assert len(take(pool, "free", "x", 10, tenant_cap=None)) == 10


def test_unknown_tier_raises() -> None:
    with pytest.raises(ValueError):
        make_pool().try_acquire("gold", "t")


# -- release -------------------------------------------------------------------------


def test_double_release_raises() -> None:
    pool = make_pool()
    g = take(pool, "premium", "p", 1)[0]
    pool.release(g)
    with pytest.raises(SlotReleaseError):
        pool.release(g)
    assert pool.in_use().total == 0


def test_release_to_another_pool_or_forged_grant_raises() -> None:
    a, b = make_pool(), make_pool()
    g = take(a, "premium", "p", 1)[0]
    take(b, "premium", "p", 1)  # same id in b
    with pytest.raises(SlotReleaseError):
        b.release(g)
    forged = SlotGrant(id=g.id, tier="premium", tenant="p", pool="shared", issuer=g.issuer)
    with pytest.raises(SlotReleaseError):
        a.release(forged)
    a.release(g)


def test_grant_is_frozen() -> None:
    g = take(make_pool(), "premium", "p", 1)[0]
    with pytest.raises(FrozenInstanceError):
        g.pool = "shared"  # type: ignore[misc]


# -- watermark scaling ---------------------------------------------------------------


def test_effective_limits_cut_shared_first_then_lowest_tier_up() -> None:
    pool = make_pool()
    base = {"premium": 6, "standard": 4, "free": 2, "batch": 0}
    assert pool.effective_limits(1.0) == {"total": 20, "shared": 8, "guaranteed": base}
    assert pool.effective_limits(0.6) == {"total": 12, "shared": 0, "guaranteed": base}
    assert pool.effective_limits(0.7) == {"total": 14, "shared": 2, "guaranteed": base}
    assert pool.effective_limits(0.35) == {  # cut 13: shared 8, free 2, standard 3
        "total": 7,
        "shared": 0,
        "guaranteed": {"premium": 6, "standard": 1, "free": 0, "batch": 0},
    }
    assert pool.effective_limits(0.25) == {  # premium's guarantee goes last
        "total": 5,
        "shared": 0,
        "guaranteed": {"premium": 5, "standard": 0, "free": 0, "batch": 0},
    }
    assert pool.effective_limits(0.0)["total"] == 0


def test_effective_total_rounds_half_up() -> None:
    pool = SlotPool(5, {}, ["a"])
    assert pool.effective_limits(0.5)["total"] == 3  # round() would say 2
    assert pool.effective_limits(0.3)["total"] == 2  # 1.5 -> 2


@pytest.mark.parametrize("scale", [-0.1, 1.01, float("nan")])
def test_scale_out_of_range_raises(scale: float) -> None:
    with pytest.raises(ValueError):
        make_pool().effective_limits(scale)


def test_scaled_pool_refuses_at_the_scaled_limits() -> None:
    pool = make_pool()
    take(pool, "batch", "b", 2, scale=0.7)  # shared is 2 at 0.7
    assert isinstance(pool.try_acquire("batch", "b", scale=0.7), Denied)
    assert isinstance(pool.try_acquire("batch", "b", scale=1.0), SlotGrant)


def test_shrinking_never_revokes_and_refuses_until_usage_drops() -> None:
    pool = make_pool()
    shared = take(pool, "batch", "b", 8)
    assert pool.in_use().total == 8
    # At scale 0.25 the budget is 5 (all premium), but 8 shared slots are held:
    denied = pool.try_acquire("premium", "p", scale=0.25)
    assert isinstance(denied, Denied) and denied.reason == "slots_exhausted"
    assert pool.in_use().total == 8  # nothing revoked
    for g in shared[:4]:
        pool.release(g)
    assert isinstance(pool.try_acquire("premium", "p", scale=0.25), SlotGrant)  # 5 of 5
    assert isinstance(pool.try_acquire("premium", "p", scale=0.25), Denied)


# -- reconfigure and reporting -------------------------------------------------------


def test_reconfigure_keeps_holdings_even_of_removed_tiers() -> None:
    pool = make_pool()
    free = take(pool, "free", "f", 3)  # 2 guaranteed + 1 shared
    pool.reconfigure(10, {"premium": 5}, ["premium", "standard"])
    usage = pool.in_use()
    assert usage.total == 3 and usage.by_tier["free"] == 3
    assert usage.guaranteed["premium"] == 0  # configured tiers always listed
    with pytest.raises(ValueError):
        pool.try_acquire("free", "f")
    assert len(take(pool, "standard", "s", 2)) == 2  # shared is 5, 1 held by free
    for g in free:
        pool.release(g)
    assert pool.in_use().total == 2


@pytest.mark.parametrize(
    "total,guaranteed,order,caps",
    [
        (5, {"a": 6}, ["a"], None),  # guarantees exceed total
        (5, {"x": 1}, ["a"], None),  # unknown tier
        (5, {}, [], None),  # no tiers
        (5, {}, ["a", "a"], None),  # duplicate tier
        (5, {"a": -1}, ["a"], None),
        (-1, {}, ["a"], None),
        (5, {}, ["a"], {"x": 1}),
    ],
)
def test_invalid_configuration_raises(
    total: int, guaranteed: dict[str, int], order: list[str], caps: dict[str, int] | None
) -> None:
    with pytest.raises(ValueError):
        SlotPool(total, guaranteed, order, caps)


def test_snapshot_is_plain_data() -> None:
    pool = make_pool(burst_caps={"batch": 2})
    take(pool, "premium", "p", 1)
    snap = pool.snapshot(scale=0.6)
    assert snap["effective"]["total"] == 12
    assert snap["in_use"]["by_tenant"] == {"p": 1}
    assert snap["in_use"]["guaranteed"]["premium"] == 1
    assert snap["burst_caps"] == {"batch": 2}


# -- properties ----------------------------------------------------------------------

_tenants = st.sampled_from(["a", "b", "c", "d"])
_scales = st.sampled_from([1.0, 0.9, 0.75, 0.6, 0.35, 0.1, 0.0])
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from(TIERS), _tenants, _scales),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    max_size=80,
)
_configs = st.tuples(
    st.integers(0, 12),
    st.lists(st.integers(0, 4), min_size=4, max_size=4),
    st.dictionaries(st.sampled_from(TIERS), st.integers(0, 5), max_size=2),
    st.dictionaries(_tenants, st.integers(0, 6), max_size=3),
).filter(lambda c: sum(c[1]) <= c[0])


@settings(max_examples=200, deadline=None)
@given(config=_configs, ops=_ops)
def test_property_limits_hold_denials_are_justified_and_nothing_leaks(
    config: tuple[int, list[int], dict[str, int], dict[str, int]], ops: list[tuple]
) -> None:
    total, g_list, caps, tenant_caps = config
    guaranteed = dict(zip(TIERS, g_list, strict=True))
    pool = SlotPool(total, guaranteed, TIERS, caps)
    held: list[SlotGrant] = []
    for op in ops:
        if op[0] == "release":
            if held:
                pool.release(held.pop(op[1] % len(held)))
            continue
        _, tier, tenant, scale = op
        lim = pool.effective_limits(scale)
        assert lim["total"] == lim["shared"] + sum(lim["guaranteed"].values())
        # model counts before the attempt
        g_held = Counter(g.tier for g in held if g.pool == "guaranteed")
        s_held = Counter(g.tier for g in held if g.pool == "shared")
        t_held = Counter(g.tenant for g in held)
        cap = tenant_caps.get(tenant)
        result = pool.try_acquire(tier, tenant, tenant_cap=cap, scale=scale)
        if isinstance(result, SlotGrant):
            held.append(result)
            assert result.tier == tier and result.tenant == tenant
            assert len(held) <= lim["total"]
            assert cap is None or t_held[tenant] + 1 <= cap
            if result.pool == "guaranteed":
                # a guaranteed slot is always the requesting tier's own
                assert g_held[tier] + 1 <= lim["guaranteed"][tier]
            else:
                assert g_held[tier] >= lim["guaranteed"][tier]  # own slots first
                assert sum(s_held.values()) + 1 <= lim["shared"]
                assert tier not in caps or s_held[tier] + 1 <= caps[tier]
        else:
            # No false denials: the refusal must follow from the model.
            if result.reason == "slots_tenant_cap":
                assert cap is not None and t_held[tenant] >= cap
            else:
                assert result.reason == "slots_exhausted"
                assert cap is None or t_held[tenant] < cap
                assert len(held) >= lim["total"] or (
                    g_held[tier] >= lim["guaranteed"][tier]
                    and (
                        sum(s_held.values()) >= lim["shared"]
                        or (tier in caps and s_held[tier] >= caps[tier])
                    )
                )
        usage = pool.in_use()
        assert usage.total == len(held)
        assert dict(+Counter(usage.by_tenant)) == dict(+Counter(g.tenant for g in held))
    for g in held:
        pool.release(g)
    usage = pool.in_use()
    assert usage.total == 0 and usage.shared == 0 and usage.by_tenant == {}
    assert all(v == 0 for v in usage.guaranteed.values())
    assert all(v == 0 for v in usage.by_tier.values())
    if held:
        with pytest.raises(SlotReleaseError):
            pool.release(held[0])


@settings(max_examples=100, deadline=None)
@given(
    total=st.integers(0, 40),
    g_list=st.lists(st.integers(0, 10), min_size=4, max_size=4),
    scale=st.floats(0, 1),
)
def test_property_cut_order_and_monotonicity(total: int, g_list: list[int], scale: float) -> None:
    if sum(g_list) > total:
        return
    pool = SlotPool(total, dict(zip(TIERS, g_list, strict=True)), TIERS)
    lim = pool.effective_limits(scale)
    assert lim["total"] == lim["shared"] + sum(lim["guaranteed"].values())
    assert 0 <= lim["total"] <= total
    assert abs(lim["total"] - total * scale) <= 0.5 + 1e-9
    kept = [lim["guaranteed"][t] for t in TIERS]
    # shared goes first: any guaranteed cut means shared is already 0
    if kept != g_list:
        assert lim["shared"] == 0
    # a tier loses slots only if every lower tier has lost all of its slots
    for i in range(len(TIERS)):
        if kept[i] < g_list[i]:
            assert all(kept[j] == 0 for j in range(i + 1, len(TIERS)))
    # lower scale never yields higher limits
    lower = pool.effective_limits(scale / 2)
    assert lower["shared"] <= lim["shared"]
    assert all(lower["guaranteed"][t] <= lim["guaranteed"][t] for t in TIERS)
