"""The placement index (extproc.policy.placement_index) chooses what placement.pick does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.placement import Candidate, pick, second_choice
from extproc.policy.placement_index import PlacementIndex, budget_room, for_footprint

KEYS = [f"10.0.0.{i}:8000" for i in range(12)]


@st.composite
def candidate(draw: st.DrawFn, key: str) -> tuple[Candidate, int | None]:
    # Few distinct values, so that groups hold several candidates and scores tie.
    cap = draw(st.sampled_from([None, 1000, 1000, 4000]))
    c = Candidate(
        key=key,
        usable=draw(st.booleans()) or draw(st.booleans()),
        kv_in_use=draw(st.sampled_from([0, 0, 100, 500, 900, 1200, 3000])),
        kv_capacity=cap,
        kv_scale=draw(st.sampled_from([1.0, 1.0, 0.6, 0.75, 2.0])),
        in_flight=draw(st.integers(0, 4)),
        max_concurrency=draw(st.sampled_from([1, 4, 8])),
        waiting=draw(st.sampled_from([0.0, 0.0, 2.5, -1.0])),
    )
    lease = draw(st.sampled_from([None, None, -10, 0, 200, 5000]))
    return c, None if cap is None else lease


@st.composite
def pool(draw: st.DrawFn) -> list[tuple[Candidate, int | None]]:
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=0, max_size=len(KEYS), unique=True))
    return [draw(candidate(k)) for k in keys]


FOOTPRINTS = st.sampled_from([0, 16, 100, 400, 900, 1000, 1500, 4000, 9000])


@settings(max_examples=400, deadline=None)
@given(
    pool(),
    FOOTPRINTS,
    st.sampled_from([None, *KEYS[:4]]),
    st.sampled_from([0.0, 0.2, 0.9]),
    st.lists(st.sampled_from(KEYS[:6]), max_size=3),
    st.data(),
)
def test_pick_and_second_choice_equal_the_scan(
    cands: list[tuple[Candidate, int | None]],
    kv: int,
    preferred: str | None,
    min_headroom: float,
    exclude: list[str],
    data: st.DataObject,
) -> None:
    index = PlacementIndex()
    for c, room in cands:
        index.put(c, room)
    # Some endpoints change after they were put: the index follows the latest.
    for i in (
        data.draw(st.lists(st.integers(0, max(0, len(cands) - 1)), max_size=3)) if cands else []
    ):
        c, room = data.draw(candidate(cands[i][0].key))
        cands[i] = (c, room)
        index.put(c, room)
    seen = [for_footprint(c, room, kv) for c, room in cands]
    want = pick(seen, kv, preferred, min_headroom, set(exclude))
    got, second = index.pick(kv, preferred, min_headroom, set(exclude))
    assert got == want
    assert second == (None if want is None else second_choice(seen, kv, want.key, set(exclude)))
    assert index.fits(kv, set(exclude)) == (pick(seen, kv, exclude=set(exclude)) is not None)
    assert [index.candidate(c.key, kv) for c, _ in cands] == seen


def test_removed_endpoints_are_never_picked() -> None:
    index = PlacementIndex()
    for key in KEYS[:3]:
        index.put(Candidate(key, True, 0, 1000, 1.0, 0, 4))
    index.remove(KEYS[0])
    index.remove("not-there:1")
    got, second = index.pick(10)
    assert got is not None and (got.key, second) == (KEYS[1], KEYS[2])
    assert len(index) == 2 and KEYS[0] not in index and index.groups == 1


def test_a_short_lease_skips_an_endpoint_without_ending_its_group() -> None:
    index = PlacementIndex()
    index.put(Candidate("a:1", True, 0, 1000, 1.0, 0, 4), lease_room=50)  # best score, small lease
    index.put(Candidate("b:1", True, 100, 1000, 1.0, 0, 4))
    got, second = index.pick(100)
    assert got is not None and (got.key, second) == ("b:1", None)
    got, second = index.pick(50)
    assert got is not None and (got.key, second) == ("a:1", "b:1")


def test_budget_room_is_what_fits_takes() -> None:
    c = Candidate("a:1", True, 400, 1000, 0.6, 0, 4)  # budget 600: 200 more
    assert budget_room(c) == 200
    assert (
        budget_room(Candidate("a:1", True, 0, 1000, 0.6, 0, 4)) == 1000
    )  # a lone request: the whole cache
    assert budget_room(Candidate("a:1", True, 5, None, 0.6, 0, 4)) == float("inf")
