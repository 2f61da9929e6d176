"""A pool's two ways of placing agree where KV shares bind nothing, and bind where they should.

Placement goes through the index (``extproc.backends.endpoint_index``) unless some tier has
a KV share; then it scans candidates built for the tier placed
(``extproc.backends.shared_kv_placement``). Where the shares reserve nothing and cap
nothing (no share set for the tier, the guaranteed tiers idle), the scan must pick what the
index picks: two ``EndpointSet``s fed the same random history, one placing each way. Both
also keep each endpoint's reservations per tier equal to its holds, through places,
releases, moves and drains, which the index's count hooks do not see.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.backends.endpoints import EndpointSet
from extproc.backends.shared_kv_placement import Shares
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.kv_shares import KvShare
from tests.test_pool_index import ADDRESSES, FOOTPRINT, backend, pools

TIERS = ("hi", "mid", "lo")
# Shares that bind nothing for the tier placed: none set at all, the placed tier's own
# guarantee (it never bars the tier itself), another tier's guarantee while that tier is idle.
QUIET: list[tuple[dict[str, KvShare], dict[str, bool]]] = [
    ({}, {}),
    ({"hi": KvShare(0.5, None)}, {"hi": False}),
    ({"hi": KvShare(0.3, None), "mid": KvShare(0.2, None)}, {"hi": False, "mid": False}),
]
OPS = st.sampled_from(
    ["place"] * 6 + ["release"] * 3 + ["time"] * 2 + ["sample"] * 2
    + ["breaker", "lease", "move", "fits", "candidates", "reload"]
)


def quiet(tier: str, which: int) -> Shares:
    table, active = QUIET[which]
    return tier, table, active


def per_tier(held: list[tuple[str, int, str]], key: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for k, kv, tier in held:
        if k == key:
            out[tier] += kv
    return +out


@settings(max_examples=120, deadline=None)
@given(pools(), st.booleans(), st.integers(0, len(QUIET) - 1), st.data())
def test_the_scan_places_as_the_index_where_shares_bind_nothing(
    endpoints: list[dict[str, Any]], affinity: bool, which: int, data: st.DataObject
) -> None:
    spec = backend(endpoints, affinity)
    index, scan = EndpointSet.create(spec, 0.0), EndpointSet.create(spec, 0.0)
    both = (index, scan)
    now = 0.0
    held: list[tuple[str, int, str]] = []  # (endpoint, footprint, tier)
    for _ in range(data.draw(st.integers(10, 60))):
        keys = list(index.by_key)
        op = data.draw(OPS)
        key = data.draw(st.sampled_from(keys))
        tier = data.draw(st.sampled_from(TIERS))
        shares = quiet(tier, which)
        if op == "place":
            kv = data.draw(FOOTPRINT)
            prefix = data.draw(st.sampled_from([(), (1,), (1, 2)]))
            exclude = set(data.draw(st.lists(st.sampled_from(keys), max_size=2)))
            got = index.place(kv, now, prefix, exclude, None, tier)
            assert scan.place(kv, now, prefix, exclude, shares, tier) == got
            if got is not None:
                held.append((got.key, kv, tier))
        elif op == "release" and held:
            k, kv, t = held.pop(data.draw(st.integers(0, len(held) - 1)))
            for eps in both:
                eps.release(k, kv, t)
        elif op == "move" and held:
            i = data.draw(st.integers(0, len(held) - 1))
            k, kv, t = held[i]
            to = data.draw(st.sampled_from(keys))
            moved = [eps.move(k, to, kv, tier=t) for eps in both]
            assert moved[0] == moved[1]
            if moved[0]:
                held[i] = (to, kv, t)
        elif op == "time":
            now += data.draw(st.sampled_from([0.0, 0.4, 2.0, 6.0, 30.0]))
        elif op == "sample":
            usage = data.draw(st.sampled_from([None, 0.0, 0.5, 0.8, 0.9, 1.0]))
            for eps in both:
                eps.by_key[key].wm.observe(usage, None, now)
        elif op == "breaker":
            for eps in both:
                eps.record(key, Outcome.FAILURE, None, now)
        elif op == "lease":
            lease = data.draw(st.sampled_from([None, (1, 800, 1, 500), (4, 4000, 0, 0)]))
            for eps in both:
                s = eps.by_key[key]
                if lease is None:
                    s.leased_slots, s.leased_kv, s.others_slots, s.others_kv = None, 0, 0, 0
                else:
                    s.leased_slots, s.leased_kv, s.others_slots, s.others_kv = lease
        elif op == "fits":
            kv = data.draw(FOOTPRINT)
            assert scan.fits_somewhere(kv, now, (), shares) == index.fits_somewhere(kv, now)
        elif op == "candidates":
            kv = data.draw(FOOTPRINT)
            assert scan.candidates(now, kv, shares) == index.candidates(now, kv)
        elif op == "reload" and len(endpoints) > 1:
            gone = [e for e in endpoints if e["address"] != key]  # it drains, then is forgotten
            for eps in both:
                eps.sync(backend(gone, affinity), now)
        assert list(index.by_key) == list(scan.by_key)
        for eps in both:
            for k, s in eps.by_key.items():
                assert s.kv_by_tier == per_tier(held, k)
                assert sum(s.kv_by_tier.values()) == s.kv_in_use
        held = [h for h in held if h[0] in index.by_key]


def test_an_active_tiers_guarantee_on_an_endpoint_steers_a_lower_tier_elsewhere() -> None:
    """What the scan is for: the index would put the request where it eats premium's room."""
    big, small = ADDRESSES[0], ADDRESSES[1]
    spec = backend(
        [
            {"address": big, "kv_capacity_tokens": 4000},
            {"address": small, "kv_capacity_tokens": 2000},
        ],
        False,
    )
    eps = EndpointSet.create(spec, 0.0)
    first = eps.place(1600, 0.0, shares=None, tier="hi")  # premium holds 1600 on the big one
    assert first is not None and first.key == big
    table = {"hi": KvShare(0.6, None)}  # 2400 of the big one, 1200 of the small one
    shares: Shares = ("lo", table, {"hi": True})
    # Without shares 2000 more fits the big one (2400 free there).
    picked, _ = eps.index.fresh(eps.by_key, 0.0).pick(2000)
    assert picked is not None and picked.key == big
    # With them, premium's unused 800 there leaves 1600 for others, and the small one
    # keeps 1200 of its 2000 for premium: 2000 fits nowhere, 1200 only on the big one.
    assert eps.place(2000, 0.0, shares=shares, tier="lo") is None
    assert not eps.fits_somewhere(2000, 0.0, shares=shares)
    got = eps.place(1200, 0.0, shares=shares, tier="lo")
    assert got is not None and got.key == big
    assert eps.by_key[big].kv_by_tier == Counter({"hi": 1600, "lo": 1200})
    # Premium idle: its guarantee is lent, and the lower tier may take the room.
    lent = eps.place(1000, 0.0, shares=("lo", table, {"hi": False}), tier="lo")
    assert lent is not None
    assert eps.move(got.key, small, 1200, tier="lo")
    eps.release(first.key, 1600, "hi")
    assert eps.by_key[big].kv_by_tier == (Counter({"lo": 1000}) if lent.key == big else Counter())
    assert sum(eps.by_key[small].kv_by_tier.values()) == eps.by_key[small].kv_in_use
