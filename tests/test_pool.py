"""A pool: one backend, several endpoints (extproc.endpoints), parsed, placed, reloaded."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.backends import BackendState, Hold
from extproc.policy.breaker import Outcome
from extproc.policy.schema import PolicyError, build_policy, hash_key
from extproc.policy.slots import Denied


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
    small = be.try_acquire("t", "a", None, 800, 0.0)
    assert isinstance(small, Hold)
    # 800 of 4000 beats 800 of 1000 on headroom: the first request goes to the big one.
    assert small.endpoint == "127.0.0.1:7002"
    big = be.try_acquire("t", "a", None, 3000, 0.0)
    assert isinstance(big, Hold) and big.endpoint == "127.0.0.1:7002"
    # 7002 holds 3800 of 4000: a 900 footprint fits only the small one.
    mid = be.try_acquire("t", "a", None, 900, 0.0)
    assert isinstance(mid, Hold) and mid.endpoint == "127.0.0.1:7001"
    # Pool budget says 4700 + 250 <= 5000, but no endpoint holds 250 more: refused, so it queues.
    none = be.try_acquire("t", "a", None, 250, 0.0)
    assert isinstance(none, Denied) and none.reason == "kv_exhausted"
    assert be.pool.in_use().total == 3  # the slot taken for the refused one went back
    be.release(big, 0.0)
    again = be.try_acquire("t", "a", None, 250, 0.0)
    assert isinstance(again, Hold) and again.endpoint == "127.0.0.1:7002"
    eps = be.endpoints.by_key
    assert (eps["127.0.0.1:7001"].kv_in_use, eps["127.0.0.1:7002"].kv_in_use) == (900, 1050)


def test_endpoint_slot_cap_is_checked() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "max_concurrency": 1},
                  {"address": "127.0.0.1:7002", "max_concurrency": 1}])
    holds = [be.try_acquire("t", "a", None, 10, 0.0) for _ in range(2)]
    assert {h.endpoint for h in holds if isinstance(h, Hold)} == {"127.0.0.1:7001", "127.0.0.1:7002"}
    assert isinstance(be.try_acquire("t", "a", None, 10, 0.0), Denied)


def test_stale_metrics_and_an_open_breaker_eject_an_endpoint() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "metrics_url": "http://127.0.0.1:7001/metrics"},
                  {"address": "127.0.0.1:7002"}])
    assert be.endpoints is not None
    scraped = be.endpoints.by_key["127.0.0.1:7001"]
    # Before its first scrape an endpoint with metrics is not picked.
    got = be.try_acquire("t", "a", None, 10, 0.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7002"
    be.release(got, 0.0)
    scraped.wm.observe(0.0, 0.0, 1.0)
    assert scraped.usable(1.0)
    other = be.endpoints.by_key["127.0.0.1:7002"]
    for _ in range(5):
        other.breaker.record(Outcome.FAILURE, None, 1.0)
    assert not other.usable(1.0)
    got = be.try_acquire("t", "a", None, 10, 1.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7001"
    # Silence counts as full: stale after watermark.stale_after_s (5 s), and nothing is left.
    assert not scraped.usable(7.0)
    assert isinstance(be.try_acquire("t", "a", None, 10, 7.0), Denied)


def test_a_removed_endpoint_drains_on_reload() -> None:
    be = runtime()
    assert be.endpoints is not None
    held = be.try_acquire("t", "a", None, 100, 0.0)
    assert isinstance(held, Hold) and held.endpoint == "127.0.0.1:7002"
    p = build_policy(doc(TWO[:1]))
    be.reconfigure(p.backends[0], p, 0.0)
    gone = be.endpoints.by_key["127.0.0.1:7002"]
    assert gone.draining and not gone.usable(0.0)
    for _ in range(3):
        h = be.try_acquire("t", "a", None, 100, 0.0)
        assert isinstance(h, Hold) and h.endpoint == "127.0.0.1:7001"
    be.release(held, 0.0)  # its last request finished: forgotten
    assert "127.0.0.1:7002" not in be.endpoints.by_key
    # And it comes back when the policy lists it again.
    p = build_policy(doc(TWO))
    be.reconfigure(p.backends[0], p, 0.0)
    assert not be.endpoints.by_key["127.0.0.1:7002"].draining


def test_kv_overcommit_applies_per_endpoint() -> None:
    be = runtime([{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000}], kv_overcommit=2.0)
    holds = [be.try_acquire("t", "a", None, 600, 0.0) for _ in range(4)]
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
    """A shared store (extproc/store/lease_plan.py): per-endpoint leases, the others' holdings in the score."""
    be = runtime()
    assert be.endpoints is not None
    small, big = be.endpoints.by_key["127.0.0.1:7001"], be.endpoints.by_key["127.0.0.1:7002"]
    small.leased_slots, small.leased_kv = 4, 1000
    big.leased_slots, big.leased_kv, big.others_slots, big.others_kv = 1, 500, 1, 3500
    # The big endpoint has room in this replica's lease (500), but the others hold 3500 of its 4000:
    # by headroom the small one wins.
    got = be.try_acquire("t", "a", None, 400, 0.0)
    assert isinstance(got, Hold) and got.endpoint == "127.0.0.1:7001"
    # 700 fits neither lease (600 left on the small one, 500 on the big one): refused, though the
    # engines together have room.
    assert isinstance(be.try_acquire("t", "a", None, 700, 0.0), Denied)
    # Where a bigger lease would put requests: 700 nowhere (the engines have no room for this
    # replica), 500 on the small one (it has more headroom left than the big one, full after it).
    assert be.endpoints.plan([700], 0.0) == {}
    assert be.endpoints.plan([500], 0.0) == {"127.0.0.1:7001": (1, 500)}
    big.others_kv = 0
    # The big one has room now, for one request: the others hold one of its two slots.
    assert be.endpoints.plan([700, 700], 0.0) == {"127.0.0.1:7002": (1, 700)}
    s = be.try_acquire("t", "a", None, 500, 0.0)
    assert isinstance(s, Hold) and s.endpoint == "127.0.0.1:7002"
    assert isinstance(be.try_acquire("t", "a", None, 10, 0.0), Hold)  # the small one: its lease has room
    big.leased_kv = 4000
    assert isinstance(be.try_acquire("t", "a", None, 10, 0.0), Hold)  # the big one's slot lease (1) is full ...
    assert big.in_flight == 1  # ... so it went to the small one
