"""The weighted-fair admission queue, driven by an explicit clock: no sleeps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.admission_queue import (
    AdmissionQueue,
    Enqueued,
    Rejected,
    TierQueueConfig,
)
from extproc.policy.reasons import Reason


def yes(_tier: str) -> bool:
    return True


def two_tiers(
    premium_depth: int = 10_000, free_depth: int = 10_000, wait: float = 1e9
) -> AdmissionQueue[str]:
    return AdmissionQueue(
        {
            "premium": TierQueueConfig(premium_depth, wait, weight=4, priority=100),
            "free": TierQueueConfig(free_depth, wait, weight=1, priority=0),
        }
    )


def admit_all(q: AdmissionQueue[str], n: int, can: Callable[[str], bool] = yes) -> list[str]:
    out = []
    for _ in range(n):
        item = q.next_eligible(can, 0.0)
        if item is None:
            break
        out.append(item)
    return out


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        TierQueueConfig(max_depth=-1, max_wait_s=1.0)
    with pytest.raises(ValueError):
        TierQueueConfig(max_depth=1, max_wait_s=1.0, weight=0)
    with pytest.raises(ValueError):
        AdmissionQueue({})


def test_enqueue_reports_position_and_deadline() -> None:
    q = AdmissionQueue({"a": TierQueueConfig(5, 2.5)})
    first = q.enqueue("x", "a", 10.0)
    second = q.enqueue("y", "a", 11.0)
    assert first == Enqueued("x", "a", 1, 12.5)
    assert isinstance(second, Enqueued) and second.position == 2
    assert len(q) == 2 and "x" in q and q.depth("a") == 2
    with pytest.raises(ValueError):
        q.enqueue("x", "a", 12.0)  # already queued
    with pytest.raises(ValueError):
        q.enqueue("z", "nope", 12.0)


def test_tier_depth_limit_rejects_at_once() -> None:
    q = AdmissionQueue({"a": TierQueueConfig(2, 5.0), "b": TierQueueConfig(1, 5.0)})
    assert isinstance(q.enqueue(1, "a", 0.0), Enqueued)
    assert isinstance(q.enqueue(2, "a", 0.0), Enqueued)
    r = q.enqueue(3, "a", 0.0)
    assert isinstance(r, Rejected)
    assert (r.reason, r.tier) == (Reason.QUEUE_FULL, "a")
    assert r.retry_after_s == 5.0  # no drain history yet: the tier's max wait
    assert isinstance(q.enqueue(4, "b", 0.0), Enqueued)  # other tiers unaffected
    assert q.snapshot()["tiers"]["a"]["rejected"] == 1
    zero = AdmissionQueue({"a": TierQueueConfig(0, 5.0)})
    assert isinstance(zero.enqueue(1, "a", 0.0), Rejected)


def test_global_depth_limit() -> None:
    q = AdmissionQueue(
        {"a": TierQueueConfig(10, 5.0), "b": TierQueueConfig(10, 5.0)}, max_total_depth=3
    )
    for i in range(3):
        assert isinstance(q.enqueue(i, "ab"[i % 2], 0.0), Enqueued)
    assert isinstance(q.enqueue(9, "b", 0.0), Rejected)
    q.remove(0)
    assert isinstance(q.enqueue(9, "b", 0.0), Enqueued)


def test_fifo_within_tier() -> None:
    q = AdmissionQueue({"a": TierQueueConfig(100, 60.0)})
    for i in range(20):
        q.enqueue(i, "a", i * 0.1)
    assert admit_all(q, 100) == list(range(20))  # type: ignore[comparison-overlap]
    assert q.next_eligible(yes, 5.0) is None


def test_remove_is_idempotent_and_keeps_order() -> None:
    q = AdmissionQueue({"a": TierQueueConfig(10, 60.0)})
    for i in "abcd":
        q.enqueue(i, "a", 0.0)
    assert q.remove("b")
    assert not q.remove("b")
    assert not q.remove("never")
    assert admit_all(q, 10) == ["a", "c", "d"]
    assert not q.remove("a")  # admitted items are gone too
    assert q.snapshot()["tiers"]["a"]["removed"] == 1


def test_expire_by_tier_wait_earliest_first() -> None:
    q = AdmissionQueue({"fast": TierQueueConfig(10, 1.0), "slow": TierQueueConfig(10, 10.0)})
    q.enqueue("s1", "slow", 0.0)
    q.enqueue("f1", "fast", 0.0)
    q.enqueue("f2", "fast", 0.5)
    assert q.expire(0.9) == []
    assert q.expire(1.0) == ["f1"]  # deadline reached
    q.enqueue("s2", "slow", 5.0)
    assert q.expire(12.0) == ["f2", "s1"]
    assert q.depth() == 1 and q.depth("slow") == 1
    assert q.expire(15.0) == ["s2"]
    assert q.expire(100.0) == []
    assert not q.remove("s2")


def test_oldest_wait() -> None:
    q = two_tiers()
    assert q.oldest_wait(5.0) == 0.0
    q.enqueue("f", "free", 1.0)
    q.enqueue("p", "premium", 3.0)
    assert q.oldest_wait(5.0) == 4.0
    assert q.oldest_wait(5.0, "premium") == 2.0


def test_weighted_share_under_premium_flood() -> None:
    q = two_tiers(premium_depth=50, free_depth=1000)
    admitted: Counter[str] = Counter()
    seq = 0
    t = 0.0
    for _ in range(500):
        t += 0.01
        while isinstance(q.enqueue(f"p{seq}", "premium", t), Enqueued):  # flood: fill up
            seq += 1
        seq += 1
        q.enqueue(f"f{seq}", "free", t)  # a steady stream, slower than the flood
        seq += 1
        for _ in range(4):
            item = q.next_eligible(yes, t)
            assert item is not None
            admitted[item[0]] += 1
    total = admitted["p"] + admitted["f"]
    assert total == 2000
    assert admitted["f"] / total == pytest.approx(0.2, abs=0.01)


def test_no_tier_starves_with_three_weights() -> None:
    q = AdmissionQueue(
        {
            "gold": TierQueueConfig(10_000, 1e9, weight=4, priority=3),
            "silver": TierQueueConfig(10_000, 1e9, weight=2, priority=2),
            "bronze": TierQueueConfig(10_000, 1e9, weight=1, priority=1),
        }
    )
    for i in range(2000):
        for tier in ("gold", "silver", "bronze"):
            q.enqueue(f"{tier}-{i}", tier, 0.0)
    order = [item.split("-")[0] for item in admit_all(q, 700)]
    share = Counter(order)
    assert share == {"gold": 400, "silver": 200, "bronze": 100}
    for i in range(0, 700 - 7):  # every tier shows up in any run of 7 admissions
        assert set(order[i : i + 7]) == {"gold", "silver", "bronze"}


def test_idle_tier_earns_no_credit() -> None:
    q = two_tiers()
    for i in range(100):
        q.enqueue(f"p{i}", "premium", 0.0)
    admit_all(q, 50)  # free has nothing queued meanwhile
    for i in range(20):
        q.enqueue(f"f{i}", "free", 1.0)
    nxt = [item[0] for item in admit_all(q, 10)]
    assert nxt.count("f") == 2  # its share from now on, no catch-up burst


def test_blocked_tier_does_not_block_others_and_keeps_its_turn() -> None:
    q = two_tiers()
    for i in range(100):
        q.enqueue(f"p{i}", "premium", 0.0)
        q.enqueue(f"f{i}", "free", 0.0)
    asked: list[str] = []

    def no_free(tier: str) -> bool:
        asked.append(tier)
        return tier != "free"

    got = admit_all(q, 30, no_free)
    assert len(got) == 30 and all(item.startswith("p") for item in got)
    assert "free" in asked  # it was its turn, and was skipped
    # Free can admit again: it goes next, then the 4:1 share resumes (no burst).
    nxt = [item[0] for item in admit_all(q, 10)]
    assert nxt[0] == "f"
    assert nxt.count("f") == 2
    # Only premium blocked and nothing else queued that may go: None, nothing lost.
    only_premium = two_tiers()
    only_premium.enqueue("p", "premium", 0.0)
    assert only_premium.next_eligible(lambda tier: tier != "premium", 0.0) is None
    assert only_premium.depth() == 1


def test_look_ahead_admits_one_behind_a_vetoed_head_and_uses_the_tiers_turn() -> None:
    q = two_tiers()
    for name in ("p0", "p1", "p2", "p3"):
        q.enqueue(name, "premium", 0.0)
    q.enqueue("f0", "free", 0.0)
    seen: list[list[str]] = []

    def behind(tier: str, items: list[str]) -> str | None:
        seen.append(items)
        return "p2" if tier == "premium" else None

    # The head p0 is vetoed; the caller names p2 among the two items looked at.
    got = q.next_eligible(lambda tier: tier != "premium", 0.0, behind, look_ahead=2)
    assert got == "p2" and seen == [["p1", "p2"]]
    assert q.depth("premium") == 3 and "p2" not in q and "p0" in q
    # Premium's turn was used (its tag advanced, so free at tag 0 is due now); then the
    # head goes first once it can, FIFO for the rest.
    assert admit_all(q, 4) == ["f0", "p0", "p1", "p3"]
    # Without a look-ahead, or an answer outside the window, nothing changes.
    q2 = two_tiers()
    q2.enqueue("a", "premium", 0.0)
    q2.enqueue("b", "premium", 0.0)
    assert q2.next_eligible(lambda tier: False, 0.0, lambda t, items: "b", look_ahead=0) is None
    assert q2.next_eligible(lambda tier: False, 0.0, lambda t, items: "zz", look_ahead=1) is None
    assert q2.depth() == 2


def test_ties_go_to_higher_priority() -> None:
    q = two_tiers()
    q.enqueue("f", "free", 0.0)
    q.enqueue("p", "premium", 0.0)
    assert q.next_eligible(yes, 0.0) == "p"


def test_retry_after_hint_follows_drain_rate() -> None:
    q = AdmissionQueue({"a": TierQueueConfig(100, 30.0)})
    assert q.retry_after_hint("a", 0.0) == 30.0
    for i in range(20):
        q.enqueue(i, "a", 0.0)
    for i in range(10):  # 10 admissions over 5 s: 2 per second
        assert q.next_eligible(yes, 0.5 * i) is not None
    # 10 samples over 5 s from the first admission: 2/s; 10 queued -> ~5 s
    assert q.retry_after_hint("a", 5.0) == pytest.approx(5.0)
    assert q.retry_after_hint("a", 1000.0) == 30.0  # a stalled tier: capped at max wait


def test_snapshot_counts() -> None:
    q = two_tiers(free_depth=1)
    q.enqueue("a", "free", 0.0)
    q.enqueue("b", "free", 0.0)
    q.enqueue("c", "premium", 0.0)
    q.enqueue("d", "premium", 0.0)
    q.next_eligible(yes, 1.0)
    q.remove("d")
    snap = q.snapshot()
    assert snap["depth"] == 1
    assert snap["tiers"]["free"] == {
        "depth": 1,
        "max_depth": 1,
        "max_wait_s": 1e9,
        "weight": 1,
        "priority": 0,
        "oldest_enqueued_at": 0.0,
        "enqueued": 1,
        "admitted": 0,
        "expired": 0,
        "removed": 0,
        "rejected": 1,
    }
    assert snap["tiers"]["premium"]["admitted"] == 1
    assert snap["tiers"]["premium"]["removed"] == 1


TIERS = ("hi", "mid", "lo")
enqueue_op = st.tuples(st.just("enqueue"), st.sampled_from(TIERS), st.floats(0, 0.5))
op = st.one_of(
    enqueue_op,
    enqueue_op,
    st.tuples(st.just("remove"), st.integers(0, 12), st.just(0.0)),  # k-th latest id
    st.tuples(st.just("expire"), st.just(""), st.floats(0, 3)),
    st.tuples(st.just("admit"), st.sets(st.sampled_from(TIERS)), st.floats(0, 1)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=20, max_size=200), st.integers(1, 30))
def test_every_item_leaves_exactly_once(
    ops: list[tuple[str, object, float]], max_total: int
) -> None:
    q: AdmissionQueue[int] = AdmissionQueue(
        {
            "hi": TierQueueConfig(8, 3.0, weight=4, priority=2),
            "mid": TierQueueConfig(5, 1.5, weight=2, priority=1),
            "lo": TierQueueConfig(6, 5.0, weight=1),
        },
        max_total_depth=max_total,
    )
    now = 0.0
    next_id = 0
    queued: set[int] = set()
    endings: dict[int, str] = {}

    def end(item: int, how: str) -> None:
        assert item in queued, f"{item} left twice or was never queued"
        queued.discard(item)
        assert item not in endings
        endings[item] = how

    for name, arg, dt in ops:
        now += dt
        if name == "enqueue":
            result = q.enqueue(next_id, str(arg), now)
            if isinstance(result, Enqueued):
                queued.add(next_id)
            next_id += 1
        elif name == "remove":
            item = next_id - 1 - int(arg)  # type: ignore[call-overload]
            assert q.remove(item) == (item in queued)
            if item in queued:
                end(item, "removed")
        elif name == "expire":
            for item in q.expire(now):
                end(item, "expired")
        else:
            open_tiers = set(arg)  # type: ignore[call-overload]
            got = q.next_eligible(open_tiers.__contains__, now)
            if got is not None:
                end(got, "admitted")
        assert len(q) == len(queued) <= max_total
        assert sum(q.depth(t) for t in TIERS) == len(queued)
    while (got := q.next_eligible(yes, now)) is not None:
        end(got, "admitted")
    assert not queued and len(q) == 0
    snap = q.snapshot()["tiers"]
    assert sum(s["enqueued"] for s in snap.values()) == len(endings)
    for how in ("admitted", "removed", "expired"):
        assert sum(s[how] for s in snap.values()) == list(endings.values()).count(how)
