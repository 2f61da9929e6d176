"""Prefix affinity: the key (extproc.openai_api.prefix_key), the map (extproc.policy.affinity), the rule
(extproc.policy.placement) and the pool state (extproc.backends.endpoints), without I/O."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.openai_api.body import parse_request
from extproc.openai_api.prefix_key import prefix_keys
from extproc.policy.affinity import PrefixAffinity
from extproc.policy.placement import Candidate, pick
from extproc.policy.schema import PolicyError, build_policy, hash_key
from extproc.policy.slots import Denied
from tests.backend_ops import try_acquire

SYSTEM = "You are the support assistant of a large shop. " * 60  # ~2.9 kB


def chat(*messages: tuple[str, str], model: str = "m") -> Any:
    body = {"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}
    return parse_request("chat", json.dumps(body).encode())


def keys(req: Any, model: str = "m", block: int = 256, most: int = 4096) -> tuple[int, ...]:
    return prefix_keys(req, model, block, most)


# -- the key ------------------------------------------------------------------------------
def test_a_shared_system_prompt_shares_its_leading_blocks_only() -> None:
    a = keys(chat(("system", SYSTEM), ("user", "Where is my parcel? " * 30)))
    b = keys(chat(("system", SYSTEM), ("user", "Can I return shoes? " * 30)))
    shared = len("system\x1f" + SYSTEM + "\x1fuser\x1f")  # the bytes both render the same
    n = shared // 256
    assert len(a) == len(b) > n + 1
    assert a[:n] == b[:n] and not set(a[n:]) & set(b[n:])
    other_system = keys(chat(("system", "Be terse. " + SYSTEM), ("user", "Where is my parcel?")))
    assert not set(other_system) & set(a)  # a key names everything before it


def test_the_next_turn_of_a_conversation_extends_the_previous_turns_keys() -> None:
    turn1 = chat(("system", SYSTEM[:600]), ("user", "x" * 700))
    turn2 = chat(("system", SYSTEM[:600]), ("user", "x" * 700), ("assistant", "y" * 500), ("user", "z"))
    k1, k2 = keys(turn1), keys(turn2)
    assert len(k2) > len(k1) and k2[: len(k1)] == k1


def test_keys_are_bounded_and_cheap_whatever_the_prompt() -> None:
    huge = chat(("system", "é" * 2_000_000), ("user", "hi"))  # 4 MB of UTF-8
    t0 = time.perf_counter()
    k = prefix_keys(huge, "m", 1024, 16384)
    elapsed = time.perf_counter() - t0
    assert len(k) == 16  # prefix_max_bytes / prefix_block_bytes, never more
    assert elapsed < 0.05  # only the first 16 KiB are encoded and hashed
    many = chat(*[("user", "w" * 10) for _ in range(5000)])
    assert len(prefix_keys(many, "m", 1024, 16384)) == 16


def test_model_seeds_the_key_embeddings_have_none_and_short_prompts_none() -> None:
    req = chat(("system", SYSTEM))
    assert set(keys(req, "m")).isdisjoint(keys(req, "other"))
    assert keys(chat(("user", "short"))) == ()
    emb = parse_request("embeddings", json.dumps({"model": "m", "input": SYSTEM}).encode())
    assert keys(emb) == ()
    comp = parse_request("completions", json.dumps({"model": "m", "prompt": SYSTEM}).encode())
    assert len(keys(comp)) == len(SYSTEM.encode()) // 256


def test_text_boundaries_matter() -> None:
    a = chat(("user", "a" * 300), ("user", "b" * 300))
    b = chat(("user", "a" * 299), ("user", "ab" + "b" * 299))
    assert keys(a)[0] == keys(b)[0] and keys(a)[1] != keys(b)[1]


# -- the map ------------------------------------------------------------------------------
def test_map_answers_the_longest_known_prefix_and_expires_and_is_bounded() -> None:
    m = PrefixAffinity(max_entries=5, ttl_s=10)
    m.record([1, 2], "e1:1", 0.0)
    m.record([1, 2, 3], "e2:1", 1.0)
    assert m.lookup([1, 2, 3, 4], 2.0) == ("e2:1", 3)
    assert m.lookup([1, 99], 2.0) == ("e2:1", 1)  # "a" was last served by e2
    assert m.lookup([98], 2.0) is None and m.lookup([], 2.0) is None
    assert m.lookup([1], 11.5) is None and len(m) == 2  # expired, and dropped on the way
    m.record([11, 12, 13, 14, 15, 16], "e1:1", 20.0)
    assert len(m) == 5 and m.lookup([11], 20.0) is None and m.lookup([16], 20.0) == ("e1:1", 1)
    m.forget("e1:1")
    assert len(m) == 0


# -- the rule -----------------------------------------------------------------------------
def cand(key: str, kv_in_use: int = 0, cap: int = 1000, usable: bool = True, in_flight: int = 0) -> Candidate:
    return Candidate(key=key, usable=usable, kv_in_use=kv_in_use, kv_capacity=cap, kv_scale=1.0,
                     in_flight=in_flight, max_concurrency=4)


def test_preferred_endpoint_wins_while_it_has_room_then_the_score_decides() -> None:
    busy, idle = cand("a:1", kv_in_use=500), cand("b:1")
    assert pick([busy, idle], 100).key == "b:1"  # the score: most headroom
    got = pick([busy, idle], 100, preferred="a:1", min_headroom=0.2)
    assert got is not None and got.key == "a:1" and got.preferred  # 0.4 free after: still preferred
    got = pick([busy, idle], 350, preferred="a:1", min_headroom=0.2)
    assert got is not None and got.key == "b:1" and not got.preferred  # 0.15 < 0.2: spills
    assert pick([cand("a:1", usable=False), idle], 10, preferred="a:1").key == "b:1"
    assert pick([cand("a:1", in_flight=4), idle], 10, preferred="a:1").key == "b:1"  # no free slot
    assert pick([cand("a:1", kv_in_use=950)], 100, preferred="a:1") is None  # does not fit: waits
    assert pick([busy, idle], 100, preferred="gone:1").key == "b:1"  # not a candidate at all


# -- the pool -----------------------------------------------------------------------------
def doc(**placement: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": "pool", "max_concurrency": 8, "kv_block_size": 10,
                      "endpoints": [{"address": "127.0.0.1:7001", "kv_capacity_tokens": 1000},
                                    {"address": "127.0.0.1:7002", "kv_capacity_tokens": 1000}],
                      "placement": placement, "models": [{"name": "m", "context_window": 8192}]}],
        "tiers": {"t": {"priority": 1, "tpm": 100000, "rpm": 100, "max_queue_depth": 8, "max_queue_wait_ms": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}],
    }


def runtime(**placement: Any) -> BackendState:
    p = build_policy(doc(**placement))
    return BackendState.create(p.backends[0], p, 0.0)


def test_pool_places_a_shared_prefix_on_one_endpoint_until_it_is_full_then_spills() -> None:
    be = runtime(prefix_affinity=True, affinity_min_headroom=0.2)
    assert be.endpoints is not None and be.endpoints.affinity is not None
    prefix = (100, 101)
    first = try_acquire(be, "t", "a", None, 200, 0.0, prefix)
    assert isinstance(first, Hold) and first.affinity == "miss"
    home = first.endpoint
    holds = [try_acquire(be, "t", "a", None, 200, 0.0, prefix) for _ in range(3)]
    # 400, 600, then 800 of 1000: 0.2 free after placement is still enough, all stay home.
    assert all(isinstance(h, Hold) and h.endpoint == home and h.affinity == "hit" for h in holds)
    spilled = try_acquire(be, "t", "a", None, 200, 0.0, prefix)
    assert isinstance(spilled, Hold) and spilled.endpoint != home and spilled.affinity == "spill"
    # The map now names where it last went; a request without keys is placed by the score.
    assert be.endpoints.affinity.lookup(prefix, 0.0) == (spilled.endpoint, 2)
    plain = try_acquire(be, "t", "a", None, 100, 0.0)
    assert isinstance(plain, Hold) and plain.affinity is None and plain.endpoint == spilled.endpoint
    assert be.endpoints.affinity_counts == {"hit": 3, "spill": 1, "miss": 1}
    # The reservation is the whole footprint: nothing is discounted for the cached prefix.
    assert be.endpoints.by_key[home].kv_in_use == 800


def test_without_prefix_affinity_the_keys_change_nothing() -> None:
    be = runtime()
    assert be.endpoints is not None and be.endpoints.affinity is None
    a = try_acquire(be, "t", "a", None, 200, 0.0, (102,))
    b = try_acquire(be, "t", "a", None, 200, 0.0, (102,))
    assert isinstance(a, Hold) and isinstance(b, Hold) and a.endpoint != b.endpoint  # the score alternates
    assert a.affinity is None


def test_reload_keeps_the_map_unless_its_bounds_change_and_drops_it_when_off() -> None:
    be = runtime(prefix_affinity=True)
    assert be.endpoints is not None
    try_acquire(be, "t", "a", None, 10, 0.0, (102,))
    kept = be.endpoints.affinity
    p = build_policy(doc(prefix_affinity=True, affinity_min_headroom=0.5))
    be.reconfigure(p.backends[0], p, 1.0)
    assert be.endpoints.affinity is kept and len(kept) == 1 and be.endpoints.placement.affinity_min_headroom == 0.5
    p = build_policy(doc(prefix_affinity=True, affinity_max_entries=10))
    be.reconfigure(p.backends[0], p, 2.0)
    assert be.endpoints.affinity is not kept and be.endpoints.affinity.max_entries == 10
    p = build_policy(doc())
    be.reconfigure(p.backends[0], p, 3.0)
    assert be.endpoints.affinity is None


@pytest.mark.parametrize("placement,needle", [
    ({"prefix_block_bytes": 16}, "prefix_block_bytes must be >= 64"),
    ({"prefix_block_bytes": 2048, "prefix_max_bytes": 1024}, "prefix_max_bytes must be >= prefix_block_bytes"),
    ({"affinity_min_headroom": 1.0}, "affinity_min_headroom must be in [0, 1)"),
    ({"prefix_affinity": "yes"}, "prefix_affinity"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_placement_settings_are_refused(placement: dict[str, Any], needle: str) -> None:
    with pytest.raises(PolicyError) as exc:
        build_policy(doc(**placement))
    assert needle in str(exc.value)


def test_a_queued_request_keeps_its_prefix_and_is_handed_its_preferred_endpoint() -> None:
    async def go() -> None:
        d = doc(prefix_affinity=True)
        for e in d["backends"][0]["endpoints"]:
            e["metrics_url"] = f"http://{e['address']}/metrics"
        p = build_policy(d)
        be = BackendState.create(p.backends[0], p, 0.0)
        assert be.endpoints is not None
        eps = list(be.endpoints.by_key.values())
        for st in eps:
            st.wm.observe(0.0, 0.0, 0.0)
        home = try_acquire(be, "t", "a", None, 100, 0.0, (7, 8))
        assert isinstance(home, Hold) and home.endpoint == "127.0.0.1:7001"  # idle tie: by address
        # Metrics go stale (silence counts as full): the next request with that prefix waits.
        assert isinstance(try_acquire(be, "t", "a", None, 200, 7.0, (7, 8)), Denied)
        w = be.queue.enqueue("t", "a", None, 200, 7.0, (7, 8))
        assert not isinstance(w, str)
        for st in eps:
            st.wm.observe(0.0, 0.0, 8.0)
        be.queue.pump(8.0)
        got = await asyncio.wait_for(w.future, 1)
        # The score alone would pick 7002 (0.8 free after placement against 0.7): the waiter's
        # prefix took it to the endpoint that served it.
        assert isinstance(got, Hold) and got.endpoint == home.endpoint and got.affinity == "hit"

    asyncio.run(go())


def test_an_endpoint_forgotten_after_removal_takes_its_prefixes_with_it() -> None:
    be = runtime(prefix_affinity=True)
    assert be.endpoints is not None and be.endpoints.affinity is not None
    h = try_acquire(be, "t", "a", None, 10, 0.0, (5,))
    assert isinstance(h, Hold)
    d = doc(prefix_affinity=True)
    d["backends"][0]["endpoints"] = [e for e in d["backends"][0]["endpoints"]
                                     if e["address"] != h.endpoint]
    p = build_policy(d)
    be.reconfigure(p.backends[0], p, 1.0)
    assert be.endpoints.affinity.lookup((5,), 1.0) == (h.endpoint, 1)  # draining: still holds a request
    be.release(h, 1.0)
    assert h.endpoint not in be.endpoints.by_key and be.endpoints.affinity.lookup((5,), 1.0) is None
