"""Fair share by work among a tier's tenants (extproc.policy.fair_share) in the admission queue."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.admission_queue import AdmissionQueue, Enqueued, TierQueueConfig
from extproc.policy.fair_share import TenantLedger, jain_index, work


def one_tier() -> AdmissionQueue[str]:
    return AdmissionQueue({"free": TierQueueConfig(10_000, 1e9)})


def yes(_tier: str) -> bool:
    return True


def dispatch(q: AdmissionQueue[str], works: dict[str, float], now: float = 0.0) -> str | None:
    """Admit the next item and charge its work, as BackendState does."""
    item = q.next_eligible(yes, now)
    if item is not None:
        tenant = item.split("-")[0]
        q.charge("free", tenant, works[item], now)
    return item


def test_work_counts_output_twice() -> None:
    assert work(100, 50) == 200.0
    assert work(-5, 0) == 0.0


def test_jain() -> None:
    assert jain_index([1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([]) == 1.0


def test_heavy_and_light_get_equal_work_not_equal_turns() -> None:
    q = one_tier()
    works: dict[str, float] = {}
    for i in range(200):
        works[f"heavy-{i}"] = 1000.0
        works[f"light-{i}"] = 100.0
        q.enqueue(f"heavy-{i}", "free", 0.0, "heavy", 1000.0)
        q.enqueue(f"light-{i}", "free", 0.0, "light", 100.0)
    got = Counter((dispatch(q, works) or "").split("-")[0] for _ in range(110))
    assert got == {"light": 100, "heavy": 10}  # ten light requests' work per heavy one
    diff, jain = q.fairness("free", 0.0)
    assert diff <= 1000.0 and jain > 0.99


def test_a_light_newcomer_goes_next_not_behind_the_heavy_backlog() -> None:
    q = one_tier()
    works = {f"heavy-{i}": 5000.0 for i in range(50)}
    for i in range(50):
        q.enqueue(f"heavy-{i}", "free", 0.0, "heavy", 5000.0)
    for _ in range(10):
        dispatch(q, works)
    works["light-0"] = 300.0
    assert q.leads("free", "light", 300.0)  # it need not even queue
    q.enqueue("light-0", "free", 1.0, "light", 300.0)
    assert q.head("free") == "light-0"
    assert dispatch(q, works) == "light-0"


def test_idle_time_earns_no_credit() -> None:
    q = one_tier()
    works = {}
    for i in range(100):
        works[f"a-{i}"] = 100.0
        q.enqueue(f"a-{i}", "free", 0.0, "a", 100.0)
    for _ in range(50):
        dispatch(q, works)  # b was idle: a was served 5000
    for i in range(40):
        works[f"b-{i}"] = 100.0
        q.enqueue(f"b-{i}", "free", 1.0, "b", 100.0)
    order = [(dispatch(q, works) or "")[0] for _ in range(20)]
    assert 9 <= order.count("b") <= 11  # an even share from now on, no catch-up burst


def test_a_tenant_with_items_queued_never_leads() -> None:
    q = one_tier()
    q.enqueue("a-0", "free", 0.0, "a", 10.0)
    assert not q.leads("free", "a", 1.0)
    assert q.leads("free", "b", 1.0)
    assert not q.leads("free", "b", 10.0)  # a tie goes to the one already waiting


def test_a_correction_at_settle_changes_the_turns() -> None:
    ledger = TenantLedger()
    ledger.charge("a", 1000.0, 0.0)
    ledger.charge("b", 1000.0, 0.0)
    ledger.charge("a", -900.0, 1.0)  # it used far less than it reserved
    assert ledger.pick([("a", 10.0, 0.0), ("b", 10.0, 0.0)]) == "a"


def test_counters_survive_a_reload() -> None:
    old = one_tier()
    old.charge("free", "a", 500.0, 0.0)
    old.charge("free", "b", 100.0, 0.0)
    new = one_tier()
    new.keep_counters(old)
    new.enqueue("b-0", "free", 0.0, "b", 1.0)
    new.enqueue("a-0", "free", 0.0, "a", 1.0)
    assert new.head("free") == "b-0"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 2000), min_size=1, max_size=5),
    st.lists(st.integers(1, 2000), min_size=1, max_size=5),
    st.integers(20, 200),
)
def test_backlogged_tenants_stay_within_one_request_of_each_other(
    a_sizes: list[int], b_sizes: list[int], n: int
) -> None:
    """VTC's bound: two tenants backlogged together differ by at most the largest request's work."""
    q = one_tier()
    works: dict[str, float] = {}
    for i in range(n):
        for t, sizes in (("a", a_sizes), ("b", b_sizes)):
            w = float(sizes[i % len(sizes)])
            works[f"{t}-{i}"] = w
            assert isinstance(q.enqueue(f"{t}-{i}", "free", 0.0, t, w), Enqueued)
    biggest = float(max(a_sizes + b_sizes))
    for _ in range(n):  # both stay backlogged: n items each, n dispatched
        dispatch(q, works)
        diff, _ = q.fairness("free", 0.0)
        assert diff <= biggest + 1e-9


def test_peer_headroom_is_what_less_served_peers_recently_needed_up_to_a_fair_share() -> None:
    from extproc.policy.fair_share import DEMAND_HALF_LIFE_S, Demand, peer_headroom

    ledger = TenantLedger()
    ledger.charge("heavy", 10_000.0, 0.0)
    ledger.charge("light", 300.0, 0.0)
    ledger.charge("mid", 5_000.0, 0.0)
    light = Demand(held=100, peak=600.0, at=9.0)
    mid = Demand(held=0, peak=5_000.0, at=9.0)
    gone = Demand(held=0, peak=900.0, at=3.0)
    demand = {
        "heavy": Demand(held=3000, waiting=30_000, peak=33_000.0, at=9.0),
        "light": light,
        "mid": mid,
        "gone": gone,
    }
    # Three seen recently (gone was not): a fair share is 3,000 of 9,000; 1.5 x a peak is kept.
    assert peer_headroom(ledger, "heavy", demand, 9000.0, 9.0, 5.0) == (900 - 100) + 3000
    assert peer_headroom(ledger, "mid", demand, 9000.0, 9.0, 5.0) == 800
    assert peer_headroom(ledger, "light", demand, 9000.0, 9.0, 5.0) == 0  # nobody was given less
    d = Demand(held=0, waiting=400)
    d.note(0.0)
    d.waiting = 0
    assert d.peak_at(DEMAND_HALF_LIFE_S) == 200.0  # the peak decays once it asks for less


def test_a_heavy_tenant_leaves_a_light_ones_room_free() -> None:
    from dataclasses import replace

    from extproc.policy.admit import SlotRequest, decide
    from extproc.policy.decision import Admit
    from extproc.policy.view import BackendSnapshot

    view = BackendSnapshot(
        kv_capacity=1000, kv_in_use=600, priorities={"free": 1}, headroom={"heavy": 200}
    )
    assert isinstance(decide(view, SlotRequest("free", "heavy", None, 200), 0.0), Admit)
    assert not isinstance(decide(view, SlotRequest("free", "heavy", None, 201), 0.0), Admit)
    assert isinstance(decide(view, SlotRequest("free", "light", None, 400), 0.0), Admit)
    lone = replace(view, kv_in_use=0)
    assert isinstance(
        decide(lone, SlotRequest("free", "heavy", None, 1000), 0.0), Admit
    )  # alone: the whole cache
    capped = replace(
        view, kv_in_use=400, headroom={"heavy": 900}
    )  # at most half of the budget is kept
    assert isinstance(decide(capped, SlotRequest("free", "heavy", None, 100), 0.0), Admit)
    assert not isinstance(decide(capped, SlotRequest("free", "heavy", None, 101), 0.0), Admit)
