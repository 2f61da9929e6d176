"""The second choice of a pool placement (extproc.policy.placement.second_choice): pure.

Envoy retries a request once on it when the picked endpoint refuses the connection.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from extproc.policy.placement import Candidate, fits, pick, score, second_choice


def cand(key: str, *, kv_in_use: int = 0, cap: int | None = 1000, scale: float = 1.0, in_flight: int = 0,
         slots: int = 8, waiting: float = 0.0, usable: bool = True) -> Candidate:
    return Candidate(key=key, usable=usable, kv_in_use=kv_in_use, kv_capacity=cap, kv_scale=scale,
                     in_flight=in_flight, max_concurrency=slots, waiting=waiting)


@pytest.mark.parametrize(("cands", "kv", "exclude", "want"), [
    # the next best by headroom
    ([cand("a:1"), cand("b:1", kv_in_use=300), cand("c:1", kv_in_use=600)], 100, (), "b:1"),
    # alone in the pool: nothing to fall back to
    ([cand("a:1")], 100, (), None),
    # the others are unusable, slot-full, or too full for the footprint
    ([cand("a:1"), cand("b:1", usable=False), cand("c:1", in_flight=8), cand("d:1", kv_in_use=950)], 100, (),
     None),
    # an endpoint owed to a blocked waiter is no fallback either
    ([cand("a:1"), cand("b:1"), cand("c:1", kv_in_use=500)], 100, ("b:1",), "c:1"),
    # by the score's later keys: the engine's queue, then Sluice's in flight, then the key
    ([cand("a:1"), cand("c:1", waiting=2), cand("b:1", waiting=3)], 10, (), "c:1"),
    ([cand("a:1"), cand("c:1"), cand("b:1")], 10, (), "b:1"),
    # no KV bound: slots only
    ([cand("a:1", cap=None), cand("b:1", cap=None, in_flight=7)], 10**6, (), "b:1"),
])
def test_second_choice_table(cands: list[Candidate], kv: int, exclude: tuple[str, ...], want: str | None) -> None:
    assert second_choice(cands, kv, "a:1", exclude) == want


def test_the_second_choice_goes_by_the_score_not_by_prefix_affinity() -> None:
    # b is preferred (it served the prefix) and wins the pick; the second is the best other by score.
    cands = [cand("a:1", kv_in_use=100), cand("b:1", kv_in_use=400), cand("c:1", kv_in_use=200)]
    got = pick(cands, 100, preferred="b:1")
    assert got is not None and got.key == "b:1" and got.preferred
    assert second_choice(cands, 100, got.key) == "a:1"


candidates = st.lists(
    st.builds(cand, st.sampled_from(["a:1", "b:1", "c:1", "d:1", "e:1"]),
              kv_in_use=st.integers(0, 1200), cap=st.one_of(st.none(), st.integers(100, 2000)),
              scale=st.floats(0.1, 1.0), in_flight=st.integers(0, 4), slots=st.integers(1, 4),
              waiting=st.floats(0, 5), usable=st.booleans()),
    min_size=1, max_size=5, unique_by=lambda c: c.key)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(1, 1500), st.sets(st.sampled_from(["a:1", "b:1", "c:1", "d:1", "e:1"]), max_size=2),
       st.one_of(st.none(), st.sampled_from(["a:1", "b:1", "c:1"])))
def test_the_second_is_never_the_primary_nor_excluded_and_fits_after_the_primarys_reservation(
        cands: list[Candidate], kv: int, exclude: set[str], preferred: str | None) -> None:
    primary = pick(cands, kv, preferred, 0.2, exclude)
    assume(primary is not None)
    assert primary is not None
    # The pool as it stands once the primary holds the request.
    after = [replace(c, kv_in_use=c.kv_in_use + kv, in_flight=c.in_flight + 1) if c.key == primary.key else c
             for c in cands]
    second = second_choice(after, kv, primary.key, exclude)
    others = [c for c in after if c.key != primary.key and c.key not in exclude and fits(c, kv)]
    if second is None:
        assert others == []
        return
    assert second != primary.key and second not in exclude
    chosen = next(c for c in after if c.key == second)
    assert chosen.usable and fits(chosen, kv)
    assert score(chosen, kv) == min(score(c, kv) for c in others)  # the best of the rest
    # Computed from the candidates before the reservation, the answer is the same.
    assert second_choice(cands, kv, primary.key, exclude) == second
