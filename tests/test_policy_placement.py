"""The endpoint picking score (extproc.policy.placement): pure, no I/O."""

from __future__ import annotations

from extproc.policy.placement import Candidate, fits, largest_capacity, pick


def cand(key: str, *, kv_in_use: int = 0, cap: int | None = 1000, scale: float = 1.0, in_flight: int = 0,
         slots: int = 8, waiting: float = 0.0, usable: bool = True) -> Candidate:
    return Candidate(key=key, usable=usable, kv_in_use=kv_in_use, kv_capacity=cap, kv_scale=scale,
                     in_flight=in_flight, max_concurrency=slots, waiting=waiting)


def test_a_long_request_goes_where_it_fits() -> None:
    full = cand("a:1", kv_in_use=900)
    roomy = cand("b:1", kv_in_use=100)
    got = pick([full, roomy], 500)
    assert got is not None and got.key == "b:1"


def test_fits_nowhere_is_none() -> None:
    assert pick([cand("a:1", kv_in_use=600), cand("b:1", kv_in_use=700)], 500) is None


def test_most_headroom_after_placement_wins_as_a_fraction() -> None:
    # 3000 of 4000 free (0.75 - 0.25) beats 700 of 1000 free.
    big = cand("big:1", cap=4000, kv_in_use=1000)
    small = cand("small:1", cap=1000, kv_in_use=100)
    got = pick([small, big], 200)
    assert got is not None and got.key == "big:1"
    # Proportional filling: the small one wins once the big one is fuller in fraction.
    got = pick([small, cand("big:1", cap=4000, kv_in_use=3000)], 200)
    assert got is not None and got.key == "small:1"


def test_watermark_scale_shrinks_an_endpoint_budget() -> None:
    scaled = cand("a:1", kv_in_use=400, scale=0.6)  # budget 600: 400 + 300 does not fit
    assert not fits(scaled, 300)
    assert fits(cand("a:1", kv_in_use=400, scale=1.0), 300)


def test_a_lone_request_fits_an_empty_endpoint_whatever_its_scale() -> None:
    assert fits(cand("a:1", scale=0.6), 900)
    assert not fits(cand("a:1", scale=0.6), 1001)


def test_unusable_and_slot_full_endpoints_are_ejected() -> None:
    assert pick([cand("a:1", usable=False)], 10) is None
    assert pick([cand("a:1", in_flight=8, slots=8)], 10) is None
    got = pick([cand("a:1", usable=False), cand("b:1", kv_in_use=999, cap=2000)], 10)
    assert got is not None and got.key == "b:1"


def test_ties_break_on_engine_queue_then_in_flight_then_key() -> None:
    got = pick([cand("a:1", waiting=3), cand("b:1", waiting=1)], 10)
    assert got is not None and got.key == "b:1"
    got = pick([cand("a:1", in_flight=3), cand("b:1", in_flight=1)], 10)
    assert got is not None and got.key == "b:1"
    got = pick([cand("b:1"), cand("a:1")], 10)
    assert got is not None and got.key == "a:1"


def test_no_kv_bound_picks_by_in_flight() -> None:
    got = pick([cand("a:1", cap=None, in_flight=2), cand("b:1", cap=None, in_flight=1)], 10_000)
    assert got is not None and got.key == "b:1"


def test_largest_capacity() -> None:
    assert largest_capacity([cand("a:1", cap=1000), cand("b:1", cap=4000)]) == 4000
    assert largest_capacity([cand("a:1", cap=None), cand("b:1", cap=4000)]) is None
    assert largest_capacity([]) is None
