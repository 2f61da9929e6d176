"""Three extproc replicas behind one Envoy, one tenant, 64 concurrent streams.

The tenant's bucket is time-scaled: ``B`` = 2 s of its rate (``r`` = 600 tokens/s), so
a run of ~45 s is ~22 bucket lengths, as many minutes with the usual one-minute bucket.
The backend has 20 slots and a 1,536-token KV budget (a quarter of the requests have
a large footprint so both limits are approached). What the backend saw is the ground
truth: its ``/metrics`` (prompt + generated tokens, running requests, KV blocks held)
sampled every 10 ms, beside each replica's ``/debug/state`` (slots in use, KV reserved).

Checked against the README's contract for the shared bucket (no term in the number
of replicas): tokens consumed in any window of ``W`` seconds ≤ 1.02 × (B + r·W); the
``excess(D)`` and false-alarm terms are 0 here up to that 2 % (estimates are exact:
each request's prompt is counted the same by Sluice and the backend, and it generates
exactly max_tokens). Steady consumption ≥ 0.95 × r; running ≤ the pool's slots; the
KV reserved by all replicas ≤ the KV budget; nothing leaks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from extproc.policy.schema import hash_key
from tests.e2e import harness
from tests.e2e.fleet import Fleet, Sampler, backend_metrics, post_counted, start_fleet, stop_fleet
from tests.e2e.harness import eventually

pytestmark = pytest.mark.e2e

REPLICAS = 3
CLIENTS = 64
SLOTS = 20
KV = 1536
RATE = 600  # tokens/s: tpm 36,000
BURST = 1200
SECONDS = 45.0
KEY = "sk-test-fleet"
SMALL, BIG = 40, 120  # max_tokens (each generates exactly that): footprints 48 and 128 tokens


def fleet_policy(sim_port: int) -> dict[str, Any]:
    doc = harness.test_policy(sim_port)
    be = doc["backends"][0]
    be["max_concurrency"] = SLOTS
    be["kv_capacity_tokens"] = KV
    doc["tiers"]["metered"] = {"priority": 50, "tpm": RATE * 60, "rpm": 1_000_000, "burst_tokens": BURST,
                               "max_concurrency": CLIENTS}
    doc["tenants"].append({"name": "t-fleet", "tier": "metered", "keys": [hash_key(KEY)]})
    return doc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tmp_path_factory.mktemp("fleet"), REPLICAS, fleet_policy)
    yield f
    stop_fleet(f)


async def _drive(url: str, seconds: float) -> dict[str, int]:
    codes: dict[str, int] = {}
    stop_at = time.monotonic() + seconds
    rng = random.Random(10)

    async def client(k: int, http: httpx.AsyncClient) -> None:
        n = BIG if k % 4 == 0 else SMALL
        body = {"model": "sim-llama-8b", "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"authorization": f"Bearer {KEY}", "x-sim-tokens": str(n), "x-sim-tps": "60"}
        while time.monotonic() < stop_at:
            await post_counted(http, url, body, headers, codes, rng, 1.0)

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        await asyncio.gather(*(client(k, http) for k in range(CLIENTS)))
    return codes


def worst_window(samples: list[tuple[float, float]], widths: tuple[float, ...], burst: float = BURST,
                 rate: float = RATE) -> tuple[float, float, float]:
    """The largest consumed / (B + r·W) over windows between samples at most each width apart.

    Returns (ratio, window start relative to the first sample, window length)."""
    worst = (0.0, 0.0, 0.0)
    t_first = samples[0][0]
    for width in widths:
        j = 0
        for i, (ti, ci) in enumerate(samples):
            j = max(j, i)
            while j + 1 < len(samples) and samples[j + 1][0] - ti <= width:
                j += 1
            tj, cj = samples[j]
            if tj - ti < width * 0.9:
                continue
            ratio = (cj - ci) / (burst + rate * (tj - ti))
            if ratio > worst[0]:
                worst = (ratio, ti - t_first, tj - ti)
    return worst


def test_three_replicas_one_tenant_64_streams_hold_every_limit(fleet: Fleet) -> None:
    f = fleet
    # every replica has seen the others register (heartbeats every ttl/3)
    eventually(lambda: {st["store"]["replicas"] for st in f.states()} == {REPLICAS}, 10, "3 replicas registered",
               interval=0.2)

    def replicas_view() -> tuple[int, int]:
        slots = kv = 0
        for st in f.states():
            be = st["backends"]["sim"]
            slots += be["slots"]["in_use"]
            kv += be["kv"]["reserved_tokens"]
        return slots, kv

    backend = Sampler(lambda: backend_metrics(f.sim_url))
    replicas = Sampler(replicas_view)
    backend.start()
    replicas.start()
    t0 = time.monotonic()
    try:
        codes = asyncio.run(_drive(f.url, SECONDS))
    finally:
        b = backend.stop()
        rs = replicas.stop()
    t_end = t0 + SECONDS
    per_replica = [st["ledger"]["charged"] for st in f.wait_settled_all(15)]
    consumed = [(t, m["vllm:prompt_tokens_total"] + m["vllm:generation_tokens_total"]) for t, m in b]
    running = max(m["vllm:num_requests_running"] for _, m in b)
    blocks = max(m["sim:kv_blocks_used"] for _, m in b)
    preempted = b[-1][1]["vllm:num_preemptions_total"]
    slots_max = max(s for _, (s, _) in rs)
    kv_max = max(k for _, (_, k) in rs)
    ratio, at, width = worst_window([s for s in consumed if s[0] <= t_end + 1.0],
                                    (0.5, 1.0, 2.0, 5.0, 10.0, 20.0))
    steady = [s for s in consumed if t0 + 5.0 <= s[0] <= t_end - 1.0]
    steady_rate = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
    print(f"\n{CLIENTS} streams, {SECONDS:.0f} s, 3 replicas: {codes}; charged per replica {per_replica}\n"
          f"backend samples {len(b)} (median gap {backend.gaps()[0] * 1e3:.1f} ms, max "
          f"{backend.gaps()[1] * 1e3:.0f} ms), replica samples {len(rs)} (median gap "
          f"{replicas.gaps()[0] * 1e3:.1f} ms)\n"
          f"worst window {ratio:.3f} x (B + r.W) (W = {width:.1f} s at t = {at:.1f} s); steady "
          f"{steady_rate:.0f} tokens/s = {steady_rate / RATE:.3f} x r\n"
          f"most running at the backend {running:.0f} / {SLOTS}, slots in use (replicas) {slots_max} / {SLOTS}, "
          f"KV reserved {kv_max} / {KV}, KV blocks held at the backend {blocks:.0f} x 16; preemptions {preempted:.0f}")
    # (a) every window within the contract, (b) steady consumption at the rate
    assert ratio <= 1.02, (ratio, at, width)
    assert steady_rate >= 0.95 * RATE, steady_rate
    # (c) slots: what the backend ran and what the replicas held, (d) KV reservations
    assert running <= SLOTS and slots_max <= SLOTS, (running, slots_max)
    assert kv_max <= KV and blocks * 16 <= KV and preempted == 0, (kv_max, blocks, preempted)
    # the run did press on the limits, through every replica
    assert codes.get("200", 0) > 0 and sum(v for k, v in codes.items() if k.startswith("429")) > 0, codes
    assert set(codes) <= {"200", "429 tpm", "429 slots", "429 kv_exhausted", "503 overloaded"}, codes
    assert all(c > 0 for c in per_replica), per_replica
    assert slots_max >= SLOTS // 2, slots_max
    # nothing leaks: every replica settled and balanced; the backend counted what Sluice charged
    for st in f.wait_settled_all(15):
        assert st["in_flight"] == 0 and st["ledger"]["outstanding"] == 0 and st["ledger"]["balanced"], st["ledger"]
    assert sum(per_replica) == backend_total(f), (per_replica, backend_total(f))
    assert min(len(b), len(rs)) >= SECONDS / 0.05  # sampled at least every 50 ms on a loaded machine


def backend_total(f: Fleet) -> float:
    m = backend_metrics(f.sim_url)
    return m["vllm:prompt_tokens_total"] + m["vllm:generation_tokens_total"]


def test_a_request_larger_than_a_lease_block_is_admitted_when_the_pool_has_room(fleet: Fleet) -> None:
    f = fleet
    f.wait_settled_all(15)
    n = 200  # footprint: 8 prompt + 200 tokens = 13 blocks = 208 tokens > the block, < the pool (1,536)
    body = {"model": "sim-llama-8b", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": n}
    headers = {"authorization": f"Bearer {KEY}", "x-sim-tokens": "10"}
    time.sleep(BURST / RATE)  # the bucket full again after the long test
    got = [httpx.post(f"{f.url}/v1/chat/completions", json=body, headers=headers, timeout=20) for _ in range(REPLICAS)]
    print("\n" + ", ".join(f"{r.status_code} {r.headers.get('x-sluice-reason', '')}" for r in got))
    assert [r.status_code for r in got] == [200] * REPLICAS  # one per replica (Envoy's round robin)
