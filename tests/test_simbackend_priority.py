"""The simulated engine's priority scheduling (vLLM's --scheduling-policy priority) and abort
log."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bench.simbackend import STATE, SimConfig, create_app
from bench.simbackend.engine import Engine, Sequence
from tests.sim_client import CHAT, aio, chat, drive
from tests.waiting import eventually_async


def test_the_waiting_queue_goes_by_priority_then_arrival() -> None:
    e = Engine(
        SimConfig(kv_blocks=1000, block_size=16, max_num_seqs=1, scheduling_policy="priority")
    )
    first = Sequence(prompt_tokens=16, max_tokens=4)
    e.add(first, 0.0)
    e.step(0.0)  # it runs; the batch (one sequence) is full
    low, high, mid, high2 = (
        Sequence(prompt_tokens=16, max_tokens=4, priority=p) for p in (5, -3, 0, -3)
    )
    for s in (low, high, mid, high2):
        e.add(s, 0.0)
    assert list(e.waiting) == [high, high2, mid, low]
    order: list[Sequence] = []
    now = 0.0
    while e.waiting or e.running:
        out = e.step(now)
        order += [s for s in out.finished if s is not first]
        now += out.duration or (out.wake_at or now) - now or 0.001
    assert order == [high, high2, mid, low]


def test_fcfs_ignores_priority() -> None:
    e = Engine(SimConfig(kv_blocks=1000, block_size=16, max_num_seqs=1))
    seqs = [Sequence(prompt_tokens=16, max_tokens=4, priority=p) for p in (5, -3, 0)]
    for s in seqs:
        e.add(s, 0.0)
    assert list(e.waiting) == seqs


def big_and_small(policy: str) -> tuple[Engine, Sequence, Sequence]:
    # 23 blocks of 16: a low-priority 256-token prompt takes 17 (and 23 once it has generated
    # its 100); a high-priority 112-token one needs 8 of the 6 left.
    e = Engine(SimConfig(kv_blocks=23, block_size=16, watermark=0.0, scheduling_policy=policy))
    low = Sequence(prompt_tokens=256, max_tokens=100, priority=10)
    e.add(low, 0.0)
    e.step(0.0)
    high = Sequence(prompt_tokens=112, max_tokens=10, priority=0)
    e.add(high, 0.001)
    return e, low, high


def test_a_waiting_high_priority_request_preempts_a_lower_one_running() -> None:
    e, low, high = big_and_small("priority")
    out = e.step(0.001)
    assert out.preempted == [low] and low.state == "waiting" and high.state == "running"
    assert e.preemptions_total == 1 and list(e.waiting) == [low]
    drive(e)
    assert high.generated == 10 and low.generated == 100  # low comes back (recompute) and finishes
    assert high.first_token_at is not None and low.first_token_at is not None


def test_under_fcfs_the_high_priority_request_waits() -> None:
    e, low, high = big_and_small("fcfs")
    out = e.step(0.001)
    assert not out.preempted and high.state == "waiting" and e.preemptions_total == 0


def test_room_to_grow_is_taken_from_the_lowest_priority_not_the_newest() -> None:
    # Chunked prefill (V1): a running sequence short of a block preempts the running sequence
    # of the lowest priority (latest arrival among equals), where fcfs takes the newest.
    for policy, victim_index in (("priority", 0), ("fcfs", 2)):
        e = Engine(
            SimConfig(
                kv_blocks=9,
                block_size=4,
                watermark=0.0,
                chunked_prefill=True,
                max_num_batched_tokens=64,
                scheduling_policy=policy,
            )
        )
        seqs = [Sequence(prompt_tokens=8, max_tokens=40, priority=p) for p in (9, 0, 1)]
        e.add(seqs[0], 0.0)  # the lowest priority is running first, so it is not the newest
        now = e.step(0.0).duration
        for s in seqs[1:]:
            e.add(s, now)
        while not e.preemptions_total:
            now += e.step(now).duration or 0.001
        assert seqs[victim_index].state == "waiting", policy
        assert all(s.state == "running" for i, s in enumerate(seqs) if i != victim_index), policy


@contextlib.asynccontextmanager
async def served(**cfg: Any) -> AsyncIterator[tuple[str, TestClient]]:
    cfg.setdefault("time_scale", 20.0)
    app = create_app(SimConfig(**cfg))
    async with TestClient(TestServer(app)) as client:
        yield str(client.make_url("")), client


@aio
async def test_priority_without_the_priority_policy_is_refused_as_vllm_does() -> None:
    async with served() as (_, c):
        r = await c.post(CHAT, json=chat(max_tokens=2, priority=-5))
        assert r.status == 400
        body = await r.json()
        assert body["error"]["message"] == "Got priority -5 but Priority scheduling is not enabled."
        assert (await c.post(CHAT, json=chat(max_tokens=2, priority=0))).status == 200
        assert (await c.post(CHAT, json=chat(max_tokens=2, priority="high"))).status == 400
    async with served(scheduling_policy="priority") as (_, c):
        assert (await c.post(CHAT, json=chat(max_tokens=2, priority=-5))).status == 200
        eng = await (await c.get("/admin/engine")).json()
        assert eng["scheduling_policy"] == "priority"


@aio
async def test_an_abort_is_logged_with_the_request_id_and_the_blocks_it_freed() -> None:
    app = create_app(SimConfig(time_scale=1.0))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    e = app[STATE].engine
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                url + CHAT,
                json=chat("x " * 300, stream=True),
                headers={"x-sim-tps": "10", "x-sim-tokens": "500", "x-request-id": "req-42"},
            )
            await r.content.readline()
            r.close()
            await eventually_async(lambda: bool(app[STATE].scheduler.aborts), 5, "the abort")
            got = await (await s.get(url + "/admin/aborts")).json()
        assert (
            got[0]["request_id"] == "req-42" and got[0]["was"] == "running" and got[0]["blocks"] > 0
        )
        assert e.used_blocks == 0 and e.finished_total["abort"] == 1
    finally:
        await runner.cleanup()


def test_an_abort_of_a_finished_sequence_frees_nothing() -> None:
    e = Engine(SimConfig())
    s = Sequence(prompt_tokens=16, max_tokens=1)
    e.add(s, 0.0)
    drive(e)
    assert e.abort(s) == -1 and e.finished_total["abort"] == 0
