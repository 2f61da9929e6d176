"""The simulated engine's own record of what it did per request (bench/simbackend/work.py):
the numbers a gateway's bill is held against, so they must be the engine's, not a guess."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from bench.simbackend import SimConfig
from bench.simbackend.engine import Engine, Sequence
from tests.sim_client import CHAT, aio, chat, drive, served, sim


def test_each_ending_leaves_one_record_with_the_engines_counts() -> None:
    e = Engine(SimConfig(kv_blocks=100, block_size=16))
    done = Sequence(prompt_tokens=40, max_tokens=7, n=2, request_id="r-done", tenant="t1")
    cut = Sequence(prompt_tokens=30, max_tokens=100, request_id="r-cut", tenant="t1")
    queued = Sequence(prompt_tokens=20, max_tokens=5, request_id="r-queued", tenant="t2")
    for s in (done, cut):
        e.add(s, 0.0)
    now = 0.0
    while cut.generated < 3:
        now += e.step(now).duration
    e.add(queued, now)
    e.abort(cut)
    e.abort(queued)  # never left the queue: no prefill to count
    drive(e)
    recs = {w.request_id: w for w in e.work.since(0)}
    assert recs["r-done"].finished_reason == "length"
    assert (recs["r-done"].prompt_tokens, recs["r-done"].generation_tokens) == (40, 14)
    assert recs["r-cut"].finished_reason == "abort"
    assert (recs["r-cut"].prompt_tokens, recs["r-cut"].generation_tokens) == (30, cut.generated)
    assert (recs["r-queued"].finished_reason, recs["r-queued"].total_tokens) == ("abort", 0)
    # The per-request records add up to the engine's vLLM-named totals.
    assert sum(w.prompt_tokens for w in recs.values()) == e.prompt_tokens_total
    assert sum(w.generation_tokens for w in recs.values()) == e.generation_tokens_total
    assert (
        e.work.by_tenant["t1"]["finished_abort"] == 1
        and e.work.by_tenant["t2"]["finished_abort"] == 1
    )
    assert e.finished_total["abort"] == 2 and e.finished_total["length"] == 1


def test_an_out_of_memory_failure_is_an_error_record_with_what_was_done() -> None:
    e = Engine(SimConfig(kv_blocks=16, block_size=16, mode="oom", watermark=0))
    seqs = [Sequence(prompt_tokens=100, max_tokens=200, request_id=f"r{i}") for i in range(3)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    errors = [w for w in e.work.since(0) if w.finished_reason == "error"]
    assert errors and all(w.prompt_tokens == 100 for w in errors)
    assert sum(w.generation_tokens for w in e.work.since(0)) == e.generation_tokens_total


def test_since_returns_only_newer_records_still_kept() -> None:
    e = Engine(SimConfig(work_log_limit=3))
    seqs = [Sequence(prompt_tokens=4, max_tokens=1, request_id=str(i)) for i in range(5)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    assert e.work.count == 5
    assert [w.request_id for w in e.work.since(0)] == ["2", "3", "4"]  # the oldest two fell off
    assert [w.request_id for w in e.work.since(3)] == ["3", "4"]
    assert e.work.since(5) == []


async def _work(s: aiohttp.ClientSession, url: str, after: int = 0) -> dict[str, Any]:
    async with s.get(f"{url}/admin/work", params={"after": str(after)}) as r:
        assert r.status == 200
        return await r.json()


async def _until_record(s: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    for _ in range(200):
        found = [w for w in (await _work(s, url))["requests"] if w["request_id"] == rid]
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no work record for {rid}")


@pytest.mark.parametrize("stream", [False, True])
@aio
async def test_a_client_that_hangs_up_aborts_its_request_and_the_record_says_what_it_cost(
    stream: bool,
) -> None:
    """vLLM aborts a request whose connection closed, streaming or not; so does the sim."""
    async with served(True, time_scale=1.0) as (url, e), aiohttp.ClientSession() as s:
        headers = {"x-request-id": f"hang-{stream}", "x-sluice-tenant": "t-hang", "x-sim-tps": "50"}
        body = chat("tell me a long story", max_tokens=1000, stream=stream)
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(
                url + CHAT, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=0.4)
            ) as r:
                await r.read()
        w = await _until_record(s, url, f"hang-{stream}")
        assert w["finished_reason"] == "abort" and w["tenant"] == "t-hang"
        # ~0.4 s at 50 tokens/s (~20): the engine stopped long before the 1000 it was asked
        # for (20 s). The bound allows a loaded host noticing the hang-up late (58 tokens,
        # ~1.2 s, seen in a full run).
        assert 5 <= w["generation_tokens"] <= 200, w
        assert w["prompt_tokens"] > 0
        assert not e.running and e.used_blocks == 0


@aio
async def test_completed_and_embedding_records_match_the_reported_usage() -> None:
    async with sim() as c:
        r = await c.post(CHAT, json=chat(max_tokens=5), headers={"x-request-id": "a"})
        usage = (await r.json())["usage"]
        r = await c.post(
            "/v1/embeddings", json={"input": ["one two", "three"]}, headers={"x-request-id": "b"}
        )
        emb = (await r.json())["usage"]
        r = await c.get("/admin/work")
        report = await r.json()
        recs = {w["request_id"]: w for w in report["requests"]}
        assert recs["a"]["prompt_tokens"] == usage["prompt_tokens"]
        assert recs["a"]["generation_tokens"] == usage["completion_tokens"]
        assert recs["a"]["finished_reason"] == "length"
        assert (
            recs["b"]["prompt_tokens"] == emb["prompt_tokens"]
            and recs["b"]["generation_tokens"] == 0
        )
        assert report["count"] == 2 and report["by_tenant"][""]["prompt_tokens"] == (
            usage["prompt_tokens"] + emb["prompt_tokens"]
        )
        r = await c.get("/admin/work", params={"after": "x"})
        assert r.status == 400
