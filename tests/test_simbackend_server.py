"""The simulated backend serving: its KV cache through HTTP, disconnects, delays, and starting it
(in a thread and from the command line)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from bench.simbackend import BackgroundServer, SimConfig
from bench.simbackend.engine import Engine
from tests.sim_client import (
    CHAT,
    aio,
    chat,
    engine_of,
    served,
    sim,
)

ROOT = Path(__file__).resolve().parent.parent


# ---- the KV model through HTTP ---------------------------------------------------------
async def _many(c: TestClient, count: int, words: int, tokens: int, **headers: str) -> list[int]:
    async def one() -> int:
        r = await c.post(
            CHAT, json=chat("alpha " * words), headers={"x-sim-tokens": str(tokens), **headers}
        )
        await r.read()
        return r.status

    return await asyncio.gather(*(one() for _ in range(count)))


@aio
async def test_overload_preempts_and_fills_the_cache() -> None:
    async with sim(kv_blocks=64, block_size=16, time_scale=50.0) as c:
        statuses = await _many(c, 10, 200, 150)
        e = engine_of(c)
        assert statuses == [200] * 10
        assert e.preemptions_total > 0 and e.peak_used_blocks >= 0.95 * e.total_blocks
        assert e.used_blocks == 0
        text = await (await c.get("/metrics")).text()
    assert re.search(r"^vllm:num_preemptions_total\{[^}]*\} [1-9]", text, re.M)


@aio
async def test_ample_cache_no_preemption() -> None:
    async with sim(kv_blocks=2048, time_scale=50.0) as c:
        assert await _many(c, 10, 200, 150) == [200] * 10
        assert engine_of(c).preemptions_total == 0


@aio
async def test_oom_mode_fails_requests_with_500() -> None:
    async with sim(
        kv_blocks=64, block_size=16, mode="oom", time_scale=50.0, oom_pause_s=100.0
    ) as c:
        e = engine_of(c)
        load = asyncio.ensure_future(_many(c, 8, 200, 150))
        while not e.oom_failures_total:
            await asyncio.sleep(0.005)
        # Paused, as if restarting after the crash: health says so.
        assert (await c.get("/health")).status == 503
        text = await (await c.get("/metrics")).text()
        assert re.search(r"^sim:oom_failures_total\{[^}]*\} [1-9]", text, re.M)
        # Time scale is live: the 100 s pause now passes in milliseconds.
        await c.post("/admin/config", json={"time_scale": 10000.0})
        statuses = await load
        assert 500 in statuses and statuses.count(500) == e.oom_failures_total
        for _ in range(100):
            if (await c.get("/health")).status == 200:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("still paused")
        # The mode is live too: preempt mode serves the same load completely.
        await c.post("/admin/config", json={"mode": "preempt", "time_scale": 50.0})
        assert await _many(c, 8, 200, 150) == [200] * 8


async def _until_freed(e: Engine) -> None:
    for _ in range(100):
        if e.used_blocks == 0 and not e.running and not e.waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {e.used_blocks}")


@pytest.mark.parametrize("cancellation", [True, False])
@aio
async def test_disconnect_frees_blocks(cancellation: bool) -> None:
    async with served(cancellation) as (url, e), aiohttp.ClientSession() as s:
        r = await s.post(
            url + CHAT,
            json=chat("x " * 500, stream=True),
            headers={"x-sim-tps": "20", "x-sim-tokens": "1000"},
        )
        await r.content.readline()  # headers and the first event arrived: it is running
        assert e.used_blocks > 0 and len(e.running) == 1
        r.close()
        await _until_freed(e)

        # Non-streaming, still waiting for its (delayed) first token.
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                url + CHAT,
                json=chat(),
                headers={"x-sim-delay-ms": "5000"},
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
        await _until_freed(e)


@aio
async def test_delay_header_delays_first_token() -> None:
    async with sim(time_scale=1.0) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await c.post(CHAT, json=chat(max_tokens=1), headers={"x-sim-delay-ms": "300"})
        assert r.status == 200
        assert loop.time() - t0 >= 0.3


# ---- starting it ------------------------------------------------------------------------
def test_background_server() -> None:
    with BackgroundServer(SimConfig(time_scale=50.0)) as srv:
        req = urllib.request.Request(
            srv.url + CHAT,
            data=json.dumps(chat(max_tokens=2)).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 2
        assert srv.call(lambda: srv.state.engine.generation_tokens_total) == 2


def test_cli_prints_listening_line() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.simbackend",
            "--port",
            "0",
            "--kv-blocks",
            "128",
            "--mode",
            "oom",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"simbackend listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(m[1] + "/admin/engine", timeout=5) as resp:
            state = json.load(resp)
        assert state["kv_blocks_total"] == 128 and state["mode"] == "oom"
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


