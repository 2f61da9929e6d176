"""How the picker's cost grows with the pool: one admission + placement, in process.

    .venv/bin/python -m bench.picker_scale [--endpoints 8 64 512] [--tenants 10000] [--n 3000] [--spread]

For a pool of 8, 64 and 512 endpoints and 10,000 tenants (each its own key), per request:

    place     admission's route (the breakers, the ladder) + the TPM charge + the slot decision
              and the pick among the endpoints (``SlotWait.acquire``) + the release
    request   the whole picker request side through ``PickerProcessor``: request headers,
              body (parse, count, admit, place), the routed answers, settle at the end

with the tenants taken round-robin and 16 requests held at any time (so the pool is not
empty). Memory is what the Runtime holds for the pool and the tenants (tracemalloc, after
a warm-up). Microseconds are the median of ``--rounds``, wall clock and this process's CPU
time; on a shared machine the CPU time and the ratio between pool sizes, measured in the
same run, are the figures to read (the load averages are printed).

``--spread``: every endpoint reports its own KV usage (fed to its watermark as a scrape
would, every 250 requests), so no two share a budget: the placement index's worst case,
one group per endpoint (extproc.policy.placement_index).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy import kv as kvmath
from extproc.policy.schema import Policy, build_policy, hash_key
from extproc.request.admission import SlotWait, route
from extproc.request.picker import PickerOptions
from extproc.runtime.runtime import Runtime
from extproc.service.picker_server import PickerProcessor
from extproc.wire.peer import PeerStream

TARGET_US = 50.0
HELD = 16


def policy(endpoints: int, tenants: int, spread: bool = False) -> Policy:
    def endpoint(i: int) -> dict[str, Any]:
        e: dict[str, Any] = {"address": f"10.{i // 250}.{i % 250}.1:8000", "kv_capacity_tokens": 200_000}
        if spread:
            e["metrics_url"] = f"http://10.{i // 250}.{i % 250}.1:8000/metrics"  # fed, not scraped
        return e

    return build_policy({
        "backends": [{"name": "pool", "max_concurrency": 64, "kv_block_size": 16,
                      "endpoints": [endpoint(i) for i in range(endpoints)],
                      "models": [{"name": "m", "context_window": 8192}]}],
        "tiers": {"std": {"priority": 10, "tpm": 10**9, "rpm": 10**9, "max_concurrency": 1000}},
        "tenants": [{"name": f"t{i}", "tier": "std", "keys": [hash_key(f"sk-{i}")]} for i in range(tenants)],
    })


async def _nothing() -> AsyncIterator[pb.ProcessingRequest]:
    if False:  # pragma: no cover - an iterator that ends at once
        yield pb.ProcessingRequest()


def feed(rt: Runtime, now: float) -> None:
    """A scrape of every endpoint that has metrics (every 250 requests or 1 s, whichever comes
    first): KV usage spread from 0.70 to 0.85, so each endpoint's watermark scale is its own."""
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    metered = [st for st in eps.by_key.values() if st.spec.metrics_url]
    for i, st in enumerate(metered):
        st.wm.observe(0.70 + 0.15 * i / len(metered), 0.0, now)


def place_round(rt: Runtime, p: Policy, n: int) -> tuple[float, float]:
    """(wall, CPU) µs per route (breakers, ladder) + TPM charge + slot and placement + release,
    with HELD requests held, tenants round-robin (``bench.admit_bench``'s steps, on a pool)."""
    be_spec = p.backends[0]
    model = be_spec.models[0]
    be = rt.backends[be_spec.name]
    tenants = list(p.tenants.values())
    peer = PeerStream(_nothing())
    kv = kvmath.footprint(200, be.kv_block_size)
    held: deque[Any] = deque()
    t0, c0 = time.perf_counter(), time.process_time()
    fed = -1e9
    for i in range(n):
        tenant = tenants[i % len(tenants)]
        limits, tier = p.limits(tenant), p.tiers[tenant.tier]
        now = rt.clock()
        if i % 250 == 0 or now - fed > 1.0:
            feed(rt, now)
            fed = now
        ticket = route(rt, p, tier, tenant.name, be_spec, model, 128, now)
        v = rt.state.admit(tenant.name, limits, 200, now, scale=be.scale(now))
        assert getattr(v, "admitted", True)
        ticket.kv = kv
        SlotWait(rt, tier, tenant.name, limits.max_concurrency, peer, lambda _: False).acquire(ticket, now)
        held.append((ticket, tenant))
        if len(held) > HELD:
            old, who = held.popleft()
            old.give_back(now)
            rt.state.settle(who.name, 200, 150, now)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    while held:
        held.popleft()[0].give_back(rt.clock())
    return dt / n * 1e6, dc / n * 1e6


def _headers(key: str) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in (
        (":path", "/v1/chat/completions"), (":method", "POST"), ("authorization", f"Bearer {key}"))])
    r = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm))
    r.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    r.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return r


BODY = pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps({
    "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "say hello to the pool"}]}).encode(),
    end_of_stream=True))


def request_round(rt: Runtime, tenants: int, n: int) -> tuple[float, float]:
    """(wall, CPU) µs per picker request side, end to end in process (settled as the stream ends)."""
    proc = PickerProcessor(rt, PickerOptions())
    msgs = [[_headers(f"sk-{i % tenants}"), BODY] for i in range(n)]

    async def one(m: list[pb.ProcessingRequest]) -> int:
        async def feed() -> AsyncIterator[pb.ProcessingRequest]:
            for x in m:
                yield x
        return len([a async for a in proc.process(feed(), None)])  # type: ignore[arg-type]

    async def go() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fed = -1e9
        for i, m in enumerate(msgs):
            if i % 250 == 0 or rt.clock() - fed > 1.0:
                feed(rt, fed := rt.clock())
            got = await one(m)
            assert got == 2, got  # the headers answer and the body
        return time.perf_counter() - t0, time.process_time() - c0

    dt, dc = asyncio.run(go())
    return dt / n * 1e6, dc / n * 1e6


def memory(endpoints: int, tenants: int, spread: bool) -> float:
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    p = policy(endpoints, tenants, spread)
    rt = Runtime(p, clock=time.monotonic)
    place_round(rt, p, min(2000, 4 * tenants))  # every tenant's state touched at least once... mostly
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(s.size_diff for s in snap.compare_to(base, "filename"))
    rt.close()
    return size / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.picker_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--tenants", type=int, default=10_000)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spread", action="store_true", help="every endpoint its own KV usage (see above)")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = []
    for e in args.endpoints:
        p = policy(e, args.tenants, args.spread)
        rt = Runtime(p, clock=time.monotonic)
        place_round(rt, p, 500)  # warm
        request_round(rt, args.tenants, 200)
        places = [place_round(rt, p, args.n) for _ in range(args.rounds)]
        reqs = [request_round(rt, args.tenants, args.n // 3) for _ in range(args.rounds)]
        rt.close()
        rows.append((e, *(statistics.median(x[i] for x in runs) for runs in (places, reqs) for i in (0, 1)),
                     memory(e, args.tenants, args.spread)))
    base = rows[0]
    print(f"{args.tenants} tenants, {HELD} requests held{', KV usage spread' if args.spread else ''}; "
          f"median of {args.rounds} rounds; load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print("| endpoints | admission + placement µs | CPU µs | CPU × vs first | picker request side µs | CPU µs "
          "| CPU × vs first | Runtime MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for e, place, place_cpu, req, req_cpu, mem in rows:
        print(f"| {e} | {place:.1f} | {place_cpu:.1f} | {place_cpu / base[2]:.2f} | {req:.1f} | {req_cpu:.1f} "
              f"| {req_cpu / base[4]:.2f} | {mem:.1f} |")
    big = [r for r in rows if r[0] >= 512]
    if big:
        print(f"\nadmission + placement at {big[-1][0]} endpoints: {big[-1][1]:.1f} µs wall, {big[-1][2]:.1f} µs CPU "
              f"(target <= {TARGET_US:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
