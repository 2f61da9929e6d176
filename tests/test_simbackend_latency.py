"""The simulated engine's latency model: load, KV, long prefills and a slowdown (fake clock)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bench.simbackend import STATE, SimConfig, create_app
from bench.simbackend.engine import Engine, Sequence


def test_decode_step_grows_with_batch_and_kv() -> None:
    e = Engine(SimConfig())
    alone = e.decode_ms(1, 100, 0.0)
    assert 10.0 < alone < 10.5  # ~100 tok/s for one short sequence
    batch = e.decode_ms(64, 64 * 100, 0.0)
    full = e.decode_ms(64, 32_000, 0.0)
    assert alone < batch < full
    assert full - batch > 5.0  # a full cache costs milliseconds per step


def rate(e: Engine, seq: Sequence, now: float, until: float) -> tuple[float, float]:
    """Step until model time ``until``; returns (tokens/s of ``seq`` over the span, now)."""
    start, gen0 = now, seq.generated
    while now < until:
        out = e.step(now)
        now += out.duration if out.duration > 0 else 0.001
    return (seq.generated - gen0) / (now - start), now


def test_a_long_context_batch_decodes_slower_than_a_short_one() -> None:
    def tps(prompt: int) -> float:
        e = Engine(SimConfig(max_model_len=32_768, kv_blocks=8192))
        seqs = [Sequence(prompt_tokens=prompt, max_tokens=10_000) for _ in range(8)]
        for s in seqs:
            e.add(s, 0.0)
        now = 0.0
        while any(s.generated == 0 for s in seqs):
            now += e.step(now).duration
        r, _ = rate(e, seqs[0], now, now + 5.0)
        return r

    short, long = tps(100), tps(12_000)
    assert long < 0.8 * short, (short, long)


def test_slowdown_halves_decode_for_its_duration_only() -> None:
    e = Engine(SimConfig())
    seq = Sequence(prompt_tokens=50, max_tokens=100_000)
    e.add(seq, 0.0)
    now = e.step(0.0).duration
    before, now = rate(e, seq, now, now + 5.0)
    e.slow_down(2.0, now + 10.0)
    during, now = rate(e, seq, now, now + 10.0)
    after, now = rate(e, seq, now, now + 5.0)
    assert during / before == pytest.approx(0.5, rel=0.05)
    assert after / before == pytest.approx(1.0, rel=0.05)
    assert e.kv_usage > 0  # the KV picture does not change


def test_a_long_prompt_prefill_stalls_running_streams() -> None:
    e = Engine(SimConfig(max_model_len=32_768, kv_blocks=4096))
    running = Sequence(prompt_tokens=50, max_tokens=10_000)
    e.add(running, 0.0)
    now = 0.0
    for _ in range(5):
        now += e.step(now).duration
    e.add(Sequence(prompt_tokens=30_000, max_tokens=10), now)
    gen = running.generated
    out = e.step(now)
    assert out.kind == "prefill" and out.duration > 0.7  # 20 ms + 25 ms per 1k prompt tokens
    assert running.generated == gen  # no token for anyone while it prefills


def test_admin_config_starts_a_slowdown() -> None:
    async def go() -> None:
        async with TestClient(TestServer(create_app(SimConfig(time_scale=20.0)))) as c:
            st = c.server.app[STATE]
            r = await c.post("/admin/config", json={"slowdown": {"factor": 2, "seconds": 20}})
            assert r.status == 200
            assert "slowdown" not in await r.json()  # not a standing setting
            assert st.engine.slow_factor == 2.0
            assert 19.0 < st.engine.slow_until - st.clock.now() <= 20.0
            bad = await c.post("/admin/config", json={"slowdown": {"factor": 0, "seconds": 1}})
            assert bad.status == 400

    asyncio.run(go())
