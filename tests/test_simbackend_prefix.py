"""The simulated engine's prefix cache (bench/simbackend/prefix_cache.py), on a fake clock."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bench.simbackend import STATE, SimConfig, create_app
from bench.simbackend.app import load_encoding
from bench.simbackend.engine import Engine, Sequence
from bench.simbackend.parse import count_prompt, parse_chat, parse_completion, prompt_token_ids
from bench.simbackend.prefix_cache import block_hashes

BS = 16


def seq(ids: list[int], max_tokens: int = 4) -> Sequence:
    s = Sequence(prompt_tokens=len(ids), max_tokens=max_tokens)
    s.block_hashes = block_hashes(ids, BS)
    return s


def run_one(e: Engine, s: Sequence, now: float) -> tuple[float, float]:
    """Add ``s`` at ``now`` and step until it finishes; returns (time to first token, end)."""
    e.add(s, now)
    while s.state != "finished":
        out = e.step(now)
        assert out.duration > 0 or out.wake_at is not None, "engine stalled"
        now += out.duration if out.duration > 0 else 0.0
        now = max(now, out.wake_at or now)
    assert s.first_token_at is not None
    return s.first_token_at, now


def accounted(e: Engine) -> int:
    private = sum(s.blocks for s in e.running)
    shared = len(e.prefix.refs) if e.prefix is not None else 0
    return private + shared + e.free_blocks


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    a = list(range(50))
    b = [999, *range(1, 50)]
    assert len(block_hashes(a, BS)) == 3  # 50 tokens: 3 full blocks, the last 2 never cached
    assert block_hashes(a, BS) == block_hashes(a[:48], BS) == block_hashes([*a, 7, 7], BS)[:3]
    # One different token in block 0 changes every later hash: a block names all before it.
    assert not set(block_hashes(a, BS)) & set(block_hashes(b, BS))
    c = [*a[:16], 5, *a[17:]]
    assert block_hashes(c, BS)[0] == block_hashes(a, BS)[0] and block_hashes(c, BS)[1:] != block_hashes(a, BS)[1:]


def test_second_identical_prompt_hits_and_skips_its_prefill() -> None:
    cfg = SimConfig(kv_blocks=1000, block_size=BS, prefix_caching=True)
    e = Engine(cfg)
    ids = list(range(2000))
    first = seq(ids)
    run_one(e, first, 0.0)
    assert e.prefix is not None and (e.prefix.queries, e.prefix.hits) == (2000, 0)
    assert e.free_blocks == e.total_blocks  # cached blocks nobody holds count as free
    assert len(e.prefix.evictable) == 2000 // BS
    second = seq(ids)
    t0 = 100.0
    e.add(second, t0)
    out = e.step(t0)
    # 124 blocks hit ((2000 - 1) // 16): only the last 16 tokens are computed.
    assert out.kind == "prefill" and second.cache_hit_tokens == 124 * BS
    assert out.duration == pytest.approx((cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * (2000 - 124 * BS) / 1000) / 1000)
    assert (e.prefix.queries, e.prefix.hits) == (4000, 124 * BS)
    uncached = (cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 2.0) / 1000
    assert out.duration < uncached / 2  # the TTFT effect: 20.4 ms instead of 70 ms
    while second.state != "finished":
        t0 += e.step(t0).duration or 0.001
    assert e.free_blocks == e.total_blocks and not e.prefix.refs


def test_shared_prefix_is_held_once_by_concurrent_sequences() -> None:
    e = Engine(SimConfig(kv_blocks=1000, block_size=BS, prefix_caching=True))
    system = list(range(1600))  # 100 blocks of shared system prompt
    a = seq([*system, *range(10_000, 10_100)], max_tokens=50)
    e.add(a, 0.0)
    now = e.step(0.0).duration  # a's prefill completes: its 106 full blocks are registered
    b = seq([*system, *range(20_000, 20_100)], max_tokens=50)
    e.add(b, now)
    e.step(now)
    assert b.state == "running" and b.cache_hit_tokens == 100 * BS
    assert set(b.cached[:100]) <= set(a.cached) and e.prefix is not None
    assert all(e.prefix.refs[h] == 2 for h in b.cached[:100])
    # The system prompt's 100 blocks are held once: 1700 + 1700 tokens fit in far fewer blocks.
    assert e.used_blocks < 2 * 1700 // BS - 90
    assert accounted(e) == e.total_blocks
    while a.state != "finished" or b.state != "finished":
        now += e.step(now).duration or 0.001
    assert e.free_blocks == e.total_blocks and not e.prefix.refs


def test_lru_eviction_of_unreferenced_blocks_when_kv_is_needed() -> None:
    # 40 blocks: A's 30 cached blocks stay after it finishes, then B needs 30 new ones.
    e = Engine(SimConfig(kv_blocks=40, block_size=BS, watermark=0.0, prefix_caching=True))
    a_ids, b_ids = list(range(480)), list(range(5000, 5480))
    run_one(e, seq(a_ids, max_tokens=1), 0.0)
    assert e.prefix is not None and len(e.prefix.evictable) == 30 and e.free_blocks == 40
    run_one(e, seq(b_ids, max_tokens=1), 10.0)
    # B needs 31 blocks (480 prompt tokens and its one output token): it took the 10
    # never-cached free blocks and evicted 21 of A's, A's *last* blocks first.
    assert e.prefix.evictions == 21
    a_hashes = block_hashes(a_ids, BS)
    assert all(h in e.prefix for h in a_hashes[:9]) and not any(h in e.prefix for h in a_hashes[9:])
    hits = e.prefix.hits
    again = seq(a_ids, max_tokens=1)
    run_one(e, again, 20.0)
    assert e.prefix.hits - hits == 9 * BS and again.cache_hit_tokens == 9 * BS
    assert e.free_blocks == e.total_blocks


def test_disabled_cache_never_hits() -> None:
    e = Engine(SimConfig(kv_blocks=1000, block_size=BS))
    ids = list(range(800))
    run_one(e, seq(ids), 0.0)
    s = seq(ids)
    e.add(s, 10.0)
    out = e.step(10.0)
    assert e.prefix is None and s.cache_hit_tokens == 0
    assert out.duration == pytest.approx((20 + 25 * 0.8) / 1000)


def test_chunked_prefill_starts_after_the_cached_blocks() -> None:
    cfg = SimConfig(kv_blocks=1000, block_size=BS, chunked_prefill=True, max_num_batched_tokens=256,
                    prefix_caching=True)
    e = Engine(cfg)
    ids = list(range(1000))
    run_one(e, seq(ids), 0.0)
    s = seq(ids)
    e.add(s, 50.0)
    out = e.step(50.0)
    # 62 blocks (992 tokens) hit; the 8 tokens left are one chunk that emits the first token.
    assert s.cache_hit_tokens == 992 and s.prefill_left == 0 and out.emitted == {s: 1}
    assert out.duration == pytest.approx((cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 8 / 1000) / 1000)


@pytest.mark.parametrize("chunked", [False, True])
def test_blocks_stay_accounted_under_preemption_with_shared_prefixes(chunked: bool) -> None:
    rnd = random.Random(7)
    e = Engine(SimConfig(kv_blocks=120, block_size=BS, chunked_prefill=chunked, max_num_batched_tokens=256,
                         prefix_caching=True))
    systems = [list(range(k * 1000, k * 1000 + 320)) for k in range(3)]
    seqs = []
    for i in range(40):
        s = seq([*rnd.choice(systems), *range(50_000 + i * 100, 50_000 + i * 100 + rnd.randrange(1, 90))],
                max_tokens=rnd.randrange(20, 200))
        s.natural_stop = True
        seqs.append(s)
        e.add(s, 0.0)
    now = 0.0
    for _ in range(100_000):
        out = e.step(now)
        assert accounted(e) == e.total_blocks and 0 <= e.free_blocks <= e.total_blocks
        if out.duration == 0 and out.wake_at is None:
            break
        now += out.duration or 0.001
    assert e.preemptions_total > 0  # the cache really ran out
    assert all(s.state == "finished" and s.generated == s.max_tokens for s in seqs)
    assert e.prefix is not None and e.prefix.hits > 0 and not e.prefix.refs
    assert e.free_blocks == e.total_blocks


def test_prompt_token_ids_count_as_count_prompt() -> None:
    enc = load_encoding()
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief " * 50},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    req = parse_chat(body)
    count, ids = prompt_token_ids(req, enc)
    assert ids is not None and count == len(ids) == count_prompt(req, enc)
    other = parse_chat({**body, "messages": [body["messages"][0], {"role": "user", "content": "bye"}]})
    _, ids2 = prompt_token_ids(other, enc)
    assert ids2 is not None and ids[:100] == ids2[:100] and ids != ids2
    batched = parse_completion({"model": "m", "prompt": ["a", "b"]})
    assert prompt_token_ids(batched, enc) == (count_prompt(batched, enc), None)


def test_http_repeated_system_prompt_hits_and_metrics_say_so() -> None:
    async def go() -> None:
        app = create_app(SimConfig(time_scale=20.0, prefix_caching=True))
        async with TestClient(TestServer(app)) as client:
            system = "You are a careful assistant. " * 200  # ~1,200 tokens
            cached = []
            for q in ("What is KV?", "What is a block?"):
                r = await client.post("/v1/chat/completions", json={
                    "model": "m", "max_tokens": 2,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
                assert r.status == 200
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            # The usage says what hit, as vLLM's prompt_tokens_details does (priced apart by budgets).
            assert cached[0] == 0 and cached[1] >= 1100 and cached[1] % 16 == 0
            text = await (await client.get("/metrics")).text()
            queries = float(re.search(r'^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$', text, re.M).group(1))
            hits = float(re.search(r'^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$', text, re.M).group(1))
            assert queries > 2400 and hits >= 1100 and hits % 16 == 0
            engine = await (await client.get("/admin/engine")).json()
            assert engine["prefix_cache"]["hits_tokens"] == hits
            assert app[STATE].engine.prefix is not None

    asyncio.run(go())
