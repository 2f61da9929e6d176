"""A pool: one backend, several endpoints (extproc.backends.endpoints), parsed, placed, reloaded."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.schema import PolicyError, build_policy, hash_key
from extproc.policy.slots import Denied
from tests.backend_ops import try_acquire


def doc(endpoints: list[dict[str, Any]], **backend: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": "pool", "max_concurrency": 4, "kv_block_size": 10, "endpoints": endpoints,
                      "models": [{"name": "m", "context_window": 8192}], **backend}],
        "tiers": {"t": {"priority": 1, "tpm": 100000, "rpm": 100, "max_queue_depth": 8,
                        "max_queue_wait_ms": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}],
    }


TWO = [{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000},
       {"address": "127.0.0.1:7002", "kv_capacity_tokens": 4000, "max_concurrency": 2}]


def runtime(endpoints: list[dict[str, Any]] = TWO, **backend: Any) -> BackendState:
    p = build_policy(doc(endpoints, **backend))
    return BackendState.create(p.backends[0], p, 0.0)


def test_endpoints_parse_with_budgets_resolved_and_summed() -> None:
    b = build_policy(doc(TWO)).backends[0]
    assert b.is_pool and [e.key for e in b.endpoints] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert [e.max_concurrency for e in b.endpoints] == [4, 2]  # the backend's, else its own
    assert b.max_concurrency == 6 and b.kv_capacity_tokens == 5000
    assert (b.host, b.port, b.metrics_url) == ("127.0.0.1", 7001, None)


def test_one_address_stays_the_simple_case() -> None:
    d = doc(TWO)
    del d["backends"][0]["endpoints"]
    d["backends"][0]["address"] = "127.0.0.1:7001"
    b = build_policy(d).backends[0]
    assert not b.is_pool and b.endpoints == ()


@pytest.mark.parametrize("endpoints,extra,needle", [
    ([], {}, "non-empty list of endpoints"),
    ([{"address": "nope"}], {}, "expected host:port"),
    ([{"address": "127.0.0.1:1"}, {"address": "127.0.0.1:1"}], {}, "duplicate endpoint"),
    ([{"address": "127.0.0.1:1", "bogus": 1}], {}, "bogus"),
    ([{"address": "127.0.0.1:1"}], {"address": "127.0.0.1:2"}, "per endpoint"),
])
def test_bad_endpoints_are_refused(endpoints: list[dict[str, Any]], extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(PolicyError) as exc:
        build_policy(doc(endpoints, **extra))
    assert needle in str(exc.value)


def test_placement_puts_a_long_request_where_it_fits_and_waits_when_nowhere() -> None:
    be = runtime()
    assert be.endpoints is not None
    small = try_acquire(be, "t", "a", None, 800, 0.0)
    assert isinstance(small, Hold)
    # 800 of 4000 beats 800 of 1000 on headroom: the first request goes to the big one.
    assert small.endpoint == "127.0.0.1:7002"
    big = try_acquire(be, "t", "a", None, 3000, 0.0)
    assert isinstance(big, Hold) and big.endpoint == "127.0.0.1:7002"
    # 7002 holds 3800 of 4000: a 900 footprint fits only the small one.
    mid = try_acquire(be, "t", "a", None, 900, 0.0)
    assert isinstance(mid, Hold) and mid.endpoint == "127.0.0.1:7001"
    # Pool budget says 4700 + 250 <= 5000, but no endpoint holds 250 more: refused, so it queues.
    none = try_acquire(be, "t", "a", None, 250, 0.0)
    assert isinstance(none, Denied) and none.reason == "kv_exhausted"
    assert be.pool.in_use().total == 3  # the slot taken for the refused one went back
    be.release(big, 0.0)
    again = try_acquire(be, "t", "a", None, 250, 0.0)
    assert isinstance(again, Hold) and again.endpoint == "127.0.0.1:7002"
    eps = be.endpoints.by_key
    assert (eps["127.0.0.1:7001"].kv_in_use, eps["127.0.0.1:7002"].kv_in_use) == (900, 1050)


def test_endpoint_slot_cap_is_checked() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "max_concurrency": 1},
                  {"address": "127.0.0.1:7002", "max_concurrency": 1}])
    holds = [try_acquire(be, "t", "a", None, 10, 0.0) for _ in range(2)]
    assert {h.endpoint for h in holds if isinstance(h, Hold)} == {"127.0.0.1:7001", "127.0.0.1:7002"}
    assert isinstance(try_acquire(be, "t", "a", None, 10, 0.0), Denied)


def test_stale_metrics_and_an_open_breaker_eject_an_endpoint() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "metrics_url": "http://127.0.0.1:7001/metrics"},
                  {"address": "127.0.0.1:7002"}])
    assert be.endpoints is not None
    scraped = be.endpoints.by_key["127.0.0.1:7001"]
    # Before its first scrape an endpoint with metrics is not picked.
    got = try_acquire(be, "t", "a", None, 10, 0.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7002"
    be.release(got, 0.0)
    scraped.wm.observe(0.0, 0.0, 1.0)
    assert scraped.usable(1.0)
    other = be.endpoints.by_key["127.0.0.1:7002"]
    for _ in range(5):
        other.breaker.record(Outcome.FAILURE, None, 1.0)
    assert not other.usable(1.0)
    got = try_acquire(be, "t", "a", None, 10, 1.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7001"
    # Silence counts as full: stale after watermark.stale_after_s (5 s), and nothing is left.
    assert not scraped.usable(7.0)
    assert isinstance(try_acquire(be, "t", "a", None, 10, 7.0), Denied)


def test_a_removed_endpoint_drains_on_reload() -> None:
    be = runtime()
    assert be.endpoints is not None
    held = try_acquire(be, "t", "a", None, 100, 0.0)
    assert isinstance(held, Hold) and held.endpoint == "127.0.0.1:7002"
    p = build_policy(doc(TWO[:1]))
    be.reconfigure(p.backends[0], p, 0.0)
    gone = be.endpoints.by_key["127.0.0.1:7002"]
    assert gone.draining and not gone.usable(0.0)
    for _ in range(3):
        h = try_acquire(be, "t", "a", None, 100, 0.0)
        assert isinstance(h, Hold) and h.endpoint == "127.0.0.1:7001"
    be.release(held, 0.0)  # its last request finished: forgotten
    assert "127.0.0.1:7002" not in be.endpoints.by_key
    # And it comes back when the policy lists it again.
    p = build_policy(doc(TWO))
    be.reconfigure(p.backends[0], p, 0.0)
    assert not be.endpoints.by_key["127.0.0.1:7002"].draining


def test_kv_overcommit_applies_per_endpoint() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000}], kv_overcommit=2.0)
    holds = [try_acquire(be, "t", "a", None, 600, 0.0) for _ in range(4)]
    assert [isinstance(h, Hold) for h in holds] == [True, True, True, False]  # 1800 <= 2000 < 2400


def test_breaker_settings_change_rebuilds_endpoint_breakers_on_reload() -> None:
    be = runtime()
    assert be.endpoints is not None
    st = be.endpoints.by_key["127.0.0.1:7001"]
    for _ in range(5):
        st.breaker.record(Outcome.FAILURE, None, 0.0)
    assert not st.usable(0.0)
    p = build_policy(doc(TWO))
    be.reconfigure(p.backends[0], p, 0.0)
    assert not st.usable(0.0), "an unchanged policy keeps the endpoint's breaker"
    p = build_policy(doc(TWO, breaker={"consecutive_failures": 9}))
    be.reconfigure(p.backends[0], p, 0.0)
    assert be.endpoints.by_key["127.0.0.1:7001"].usable(0.0)


def test_one_failing_endpoint_opens_its_breaker_not_the_pools() -> None:
    be = runtime()
    assert be.endpoints is not None
    for _ in range(5):
        assert be.endpoints.record("127.0.0.1:7001", Outcome.FAILURE, None, 0.0) == Outcome.CANCELLED
    assert not be.endpoints.by_key["127.0.0.1:7001"].usable(0.0)
    # The last one standing: its failures are the pool's.
    assert be.endpoints.record("127.0.0.1:7002", Outcome.FAILURE, None, 0.0) == Outcome.FAILURE
    assert be.endpoints.record("127.0.0.1:7002", Outcome.SUCCESS, None, 0.0) == Outcome.SUCCESS


def test_a_leased_endpoint_takes_only_what_this_replica_leases_there() -> None:
    """A shared store (extproc/runtime/leases.py): per-endpoint leases, the others' holdings in the score."""
    be = runtime()
    assert be.endpoints is not None
    small, big = be.endpoints.by_key["127.0.0.1:7001"], be.endpoints.by_key["127.0.0.1:7002"]
    small.leased_slots, small.leased_kv = 4, 1000
    big.leased_slots, big.leased_kv, big.others_slots, big.others_kv = 1, 500, 1, 3500
    # The big endpoint has room in this replica's lease (500), but the others hold 3500 of its 4000:
    # by headroom the small one wins.
    got = try_acquire(be, "t", "a", None, 400, 0.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7001"
    # 700 fits neither lease (600 left on the small one, 500 on the big one): refused, though the
    # engines together have room.
    assert isinstance(try_acquire(be, "t", "a", None, 700, 0.0), Denied)
    # Where a bigger lease would put requests: 700 nowhere (the engines have no room for this
    # replica), 500 on the small one (it has more headroom left than the big one, full after it).
    assert be.endpoints.plan([700], 0.0) == {}
    assert be.endpoints.plan([500], 0.0) == {"127.0.0.1:7001": (1, 500)}
    big.others_kv = 0
    # The big one has room now, for one request: the others hold one of its two slots.
    assert be.endpoints.plan([700, 700], 0.0) == {"127.0.0.1:7002": (1, 700)}
    s = try_acquire(be, "t", "a", None, 500, 0.0)
    assert isinstance(s, Hold) and s.endpoint == "127.0.0.1:7002"
    assert isinstance(try_acquire(be, "t", "a", None, 10, 0.0), Hold)  # the small one: its lease has room
    big.leased_kv = 4000
    assert isinstance(try_acquire(be, "t", "a", None, 10, 0.0), Hold)  # the big one's slot lease (1) is full ...
    assert big.in_flight == 1  # ... so it went to the small one


def two_tiers(endpoints: list[dict[str, Any]]) -> BackendState:
    d = doc(endpoints)
    d["tiers"] = {"hi": {"priority": 100, "tpm": 100000, "rpm": 100, "max_queue_depth": 8, "max_queue_wait_ms": 1000,
                         "queue_weight": 4},
                  "lo": {"priority": 10, "tpm": 100000, "rpm": 100, "max_queue_depth": 8, "max_queue_wait_ms": 1000}}
    d["tenants"] = [{"name": "a", "tier": "hi", "keys": [hash_key("a")]},
                    {"name": "z", "tier": "lo", "keys": [hash_key("z")]}]
    p = build_policy(d)
    return BackendState.create(p.backends[0], p, 0.0)


def test_a_premium_head_that_fits_no_endpoint_is_owed_one_and_placed_there() -> None:
    """Owed KV per endpoint: small free requests keep fitting where room frees, the premium
    request needs more than any endpoint has; it gets the endpoint nearest to fitting it,
    and the free tier goes to the other one meanwhile."""
    import asyncio

    from extproc.backends.queue import Waiter

    async def run() -> None:
        be = two_tiers([{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000},
                        {"address": "127.0.0.1:7002", "kv_capacity_tokens": 1000}])
        assert be.endpoints is not None
        eps = be.endpoints.by_key
        first = [try_acquire(be, "lo", "z", None, 300, 0.0) for _ in range(4)]  # 600 on each endpoint
        assert all(isinstance(h, Hold) for h in first)
        assert {k: e.kv_in_use for k, e in eps.items()} == {"127.0.0.1:7001": 600, "127.0.0.1:7002": 600}
        # 800 fits the pool (1200 + 800 <= 2000) but no endpoint (400 free on each): it waits.
        assert isinstance(try_acquire(be, "hi", "a", None, 800, 0.0), Denied)
        big = be.queue.enqueue("hi", "a", None, 800, 0.0)
        assert isinstance(big, Waiter)
        # Both are 400 short; the tie goes to 7001 (the key): it is owed to the premium head.
        assert be.queue.owed_endpoints("lo", 0.0) == ("127.0.0.1:7001",)
        # One free request on 7001 finishes: 700 free there. Without the rule the next free
        # request would take it (most headroom); now it goes to 7002.
        on_7001 = [h for h in first if isinstance(h, Hold) and h.endpoint == "127.0.0.1:7001"]
        be.release(on_7001[0], 0.0)
        assert not big.future.done()
        small = try_acquire(be, "lo", "z", None, 200, 0.0)
        assert isinstance(small, Hold) and small.endpoint == "127.0.0.1:7002"
        # 7002 is full for another 300; 7001 stays owed: the free request waits.
        assert isinstance(try_acquire(be, "lo", "z", None, 300, 0.0), Denied)
        assert eps["127.0.0.1:7001"].kv_in_use == 300
        # The last free request on 7001 finishes: the premium head is placed there at once.
        be.release(on_7001[1], 0.0)
        got = await asyncio.wait_for(big.future, 1)
        assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7001"
        # Nothing is owed any more: free requests may use 7001's last 200 again.
        assert be.queue.owed_endpoints("lo", 0.0) == ()
        last = try_acquire(be, "lo", "z", None, 200, 0.0)
        assert isinstance(last, Hold) and last.endpoint == "127.0.0.1:7001"
        for h in [got, small, last, *(h for h in first if h not in on_7001)]:
            assert isinstance(h, Hold)
            be.release(h, 0.0)
        assert be.kv_in_use == 0 and all(e.kv_in_use == 0 and e.in_flight == 0 for e in eps.values())

    asyncio.run(run())


def test_look_ahead_lets_smaller_premium_requests_pass_a_head_that_fits_nowhere() -> None:
    """Same tier, behind a head that fits no endpoint: a smaller request that fits an endpoint
    not owed to the head goes first; the head keeps its endpoint and is placed there."""
    import asyncio

    from extproc.backends.queue import Waiter

    async def run() -> None:
        be = two_tiers([{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000},
                        {"address": "127.0.0.1:7002", "kv_capacity_tokens": 1000}])
        assert be.endpoints is not None
        free = [try_acquire(be, "lo", "z", None, 300, 0.0) for _ in range(4)]  # 600 on each
        assert all(isinstance(h, Hold) for h in free)
        head = be.queue.enqueue("hi", "a", None, 800, 0.0)
        small = be.queue.enqueue("hi", "a", None, 300, 0.0)
        third = be.queue.enqueue("hi", "a", None, 300, 0.0)
        assert isinstance(head, Waiter) and isinstance(small, Waiter) and isinstance(third, Waiter)
        assert be.queue.tick(0.0) == 1
        got = await asyncio.wait_for(small.future, 1)
        # 7001 and 7002 have the same room and 7001 wins ties, but 7001 is owed to the head.
        assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7002"
        assert not head.future.done() and not third.future.done()
        # 7002 has 100 left, 7001 400 but owed: the third waits too.
        assert be.queue.tick(0.0) == 0
        for h in free:
            if isinstance(h, Hold) and h.endpoint == "127.0.0.1:7001":
                be.release(h, 0.0)
        placed = await asyncio.wait_for(head.future, 1)
        assert isinstance(placed, Hold) and placed.endpoint == "127.0.0.1:7001"
        assert not third.future.done()  # 200 left on 7001, 100 on 7002
        be.queue.leave(third)
        for h in [got, placed, *(h for h in free if isinstance(h, Hold) and h.endpoint == "127.0.0.1:7002")]:
            assert isinstance(h, Hold)
            be.release(h, 0.0)
        assert be.kv_in_use == 0 and be.pool.in_use().total == 0

    asyncio.run(run())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(0, 1), st.integers(1, 200),
                          st.integers(1, 8)), min_size=5, max_size=30))
def test_premium_waiters_are_placed_while_free_traffic_keeps_coming(
        steps: list[tuple[int, int, int, int, int]]) -> None:
    """The pool with both rules, driven step by step: free requests arrive every step for
    ever (the drawn steps cycled), premium ones of any size up to the largest cache only
    during the first steps. Every premium request is placed within a bound, and no
    endpoint ever holds more than its cache."""
    import asyncio

    from extproc.backends.queue import Waiter

    caps = {"127.0.0.1:7001": 800, "127.0.0.1:7002": 1600, "127.0.0.1:7003": 3200}

    async def run() -> None:
        be = two_tiers([{"address": k, "kv_capacity_tokens": c, "max_concurrency": 8} for k, c in caps.items()])
        assert be.endpoints is not None
        running: list[tuple[int, Hold]] = []  # (finishes at step, hold)
        waiting: list[tuple[Waiter, int]] = []  # (waiter, duration once placed)
        premium: list[Waiter] = []
        for step in range(400):
            at = step / 1000  # a step is 1 ms: the tick expires waits, and none reaches the 1 s deadline here
            for end, h in [r for r in running if r[0] <= step]:
                running.remove((end, h))
                be.release(h, at)
            be.queue.tick(at)
            n_free, free_blocks, has_premium, premium_blocks, duration = steps[step % len(steps)]
            arrivals = [("lo", "z", free_blocks * 10)] * n_free
            if has_premium and step < 40:
                arrivals.append(("hi", "a", premium_blocks * 16))  # up to 3200: the largest cache
            for tier, tenant, kv in arrivals:
                got = try_acquire(be, tier, tenant, None, kv, at)
                if isinstance(got, Hold):
                    running.append((step + duration, got))
                    continue
                w = be.queue.enqueue(tier, tenant, None, kv, at)
                if isinstance(w, Waiter):
                    waiting.append((w, duration))
                    if tier == "hi":
                        premium.append(w)
            await asyncio.sleep(0)
            for w, d in [x for x in waiting if x[0].future.done()]:
                waiting.remove((w, d))
                got = w.future.result()
                assert isinstance(got, Hold)
                running.append((step + d, got))
            for key, ep in be.endpoints.by_key.items():
                assert ep.kv_in_use <= caps[key] and ep.in_flight <= 8
            if step >= 40 and all(w.future.done() for w in premium):
                break
        assert all(w.future.done() for w in premium), \
            f"premium still waiting at step {step}: {[w.kv for w in premium if not w.future.done()]}"
        for w, _ in waiting:
            be.queue.leave(w)
        for _, h in running:
            be.release(h, 1000.0)
        assert be.kv_in_use == 0 and be.pool.in_use().total == 0

    asyncio.run(run())
