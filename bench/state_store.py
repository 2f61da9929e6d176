"""TPM/RPM state: the Redis store against in-process state, in one run (< 60 s).

``python -m bench.state_store`` starts a throwaway ``redis-server`` on a random port
and prints two tables:

1. per-admission policy cost (admit + settle, µs of this process) and admissions/s,
   in-process vs Redis with the lease covering (far from the limit) vs Redis when
   every admission is a round trip (at the limit, 64 concurrent clients);
2. TPM accuracy with 1 and 3 replicas (separate processes, 64 clients in all, time
   scaled: 1000 tokens/s): the worst window over its contract ``B + r·W`` and
   steady consumption over TPM.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.redis_server import RedisServer
from extproc.policy.gate import LocalState, Verdict
from extproc.policy.schema import Limits
from extproc.store.redis_state import RedisState

FAR = Limits(tpm=10**9, rpm=10**9, burst_tokens=10**9, max_concurrency=1000)
BURST, TPM = 1000, 60_000  # accuracy runs: 1000 tokens/s, a bucket of one second
TIGHT = Limits(tpm=TPM, rpm=10**9, burst_tokens=BURST, max_concurrency=1000)


async def _admit(state: Any, limits: Limits, cost: int, tenant: str = "t") -> Verdict:
    v = state.admit(tenant, limits, cost, time.monotonic())
    if not isinstance(v, Verdict):
        v = await v
    return v


def bench_local(n: int) -> tuple[float, float]:
    s = LocalState()
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        now = time.monotonic()
        s.admit("t", FAR, 20, now)
        s.settle("t", 20, 20, now)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    return cpu / n * 1e6, n / wall


async def bench_redis_far(url: str, n: int) -> tuple[float, float, float]:
    s = RedisState(url, replica_id="bench-far", prefix="benchfar")
    await _admit(s, FAR, 1)
    c0, t0, w0 = s.exchanges, time.process_time(), time.perf_counter()
    for _ in range(n):
        v = await _admit(s, FAR, 20)
        assert v.admitted
        s.settle("t", 20, 20, time.monotonic())
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    trips = (s.exchanges - c0) / n
    await s.aclose()
    await s.client.aclose()
    return cpu / n * 1e6, n / wall, trips


async def bench_redis_near(url: str, seconds: float, clients: int) -> tuple[float, float, float, float, float, float]:
    """At the limit: no lease ever covers a request, so every decision waits for Redis.

    One exchange carries every request of the tenant waiting at that moment, so the
    round trips per decision fall below 1 as clients pile up.
    """
    s = RedisState(url, replica_id="bench-near", prefix="benchnear")
    # Slices are capped at 10 % of the bucket (200), less than every request (300).
    lim = Limits(tpm=60 * 10**6, rpm=10**9, burst_tokens=2000, max_concurrency=1000)
    await _admit(s, lim, 1)
    lat: list[float] = []
    admitted = 0
    end = time.monotonic() + seconds
    c0 = s.exchanges

    async def client() -> None:
        nonlocal admitted
        while time.monotonic() < end:
            t = time.perf_counter()
            v = await _admit(s, lim, 300)
            lat.append(time.perf_counter() - t)
            if v.admitted:
                admitted += 1
                s.settle("t", 300, 300, time.monotonic())
            else:
                await asyncio.sleep(min(v.retry_after_s, 0.01))

    t0, w0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    n = len(lat)
    trips = (s.exchanges - c0) / max(n, 1)
    await s.aclose()
    await s.client.aclose()
    lat.sort()
    return cpu / n * 1e6, n / wall, admitted / wall, lat[n // 2] * 1e3, lat[int(n * 0.99)] * 1e3, trips


# -- accuracy: replicas as processes ------------------------------------------------------
def _replica(url: str, prefix: str, idx: int, clients: int, start_at: Any, seconds: float, out: Any) -> None:
    async def main() -> list[tuple[float, float, int]]:
        s = RedisState(url, replica_id=f"acc{idx}", prefix=prefix)
        await _admit(s, TIGHT, 1)  # register
        out.send("ready")
        while start_at.value == 0.0:  # the parent sets it once every replica is ready
            await asyncio.sleep(0.01)
        start = start_at.value
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        end = start + seconds
        events: list[tuple[float, float, int]] = []
        rng = random.Random(idx)

        async def client() -> None:
            while time.monotonic() < end:
                cost = rng.randint(5, 25)
                t0 = time.monotonic()
                v = await _admit(s, TIGHT, cost)
                if v.admitted:
                    events.append((t0, time.monotonic(), cost))
                    await asyncio.sleep(0.005)
                    s.settle("t", cost, cost, time.monotonic())
                else:
                    await asyncio.sleep(min(max(v.retry_after_s, 0.002), 0.05))

        await asyncio.gather(*(client() for _ in range(clients)))
        await s.aclose()
        await s.client.aclose()
        return events

    out.send(asyncio.run(main()))
    out.close()


def _worst_window(events: list[tuple[float, float, int]], w: float) -> float:
    ev = sorted(events)
    worst = 0.0
    for i, (start, _, _) in enumerate(ev):
        total = 0
        for t0, t1, cost in ev[i:]:
            if t0 > start + w:
                break
            if t1 <= start + w:
                total += cost
        worst = max(worst, total / (BURST + TPM / 60.0 * w))
    return worst


def accuracy(url: str, replicas: int, seconds: float, clients: int = 64) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    start_at = ctx.Value("d", 0.0)
    pipes, procs = [], []
    for i in range(replicas):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_replica, args=(url, f"acc{replicas}", i, clients // replicas, start_at, seconds, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    # Start together once all have imported and registered: a fixed lead was too short on a
    # loaded host, and a replica starting late lowered the steady consumption measured.
    for a in pipes:
        assert a.recv() == "ready"
    start = time.monotonic() + 0.2
    start_at.value = start
    events = [e for a in pipes for e in a.recv()]
    for p in procs:
        p.join(10)
    worst = max(_worst_window(events, w) for w in (0.5, 1.0, 2.0))
    steady = sum(c for t0, _, c in events if start + 1.0 <= t0 < start + seconds - 0.5)
    return worst, steady / (TPM / 60.0 * (seconds - 1.5))


@dataclass
class StateStoreResult:
    local_us: float = 0.0
    local_rate: float = 0.0
    far: tuple[float, float, float] = (0.0, 0.0, 0.0)  # µs per decision, decisions/s, round trips
    near: tuple[float, ...] = ()  # 64 clients: µs, decisions/s, admitted/s, p50 ms, p99 ms, round trips
    one: tuple[float, ...] = ()  # 1 client, the same fields
    accuracy: dict[int, tuple[float, float]] = field(default_factory=dict)  # replicas -> (worst, steady)
    seconds: float = 6.0


def run(seconds: float = 6.0, log: Any = None) -> StateStoreResult:
    """Every measurement of this module in one run, on one throwaway ``redis-server``."""
    out = StateStoreResult(seconds=seconds)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            if log:
                log("state store: policy cost, in-process vs Redis")
            out.local_us, out.local_rate = bench_local(100_000)
            out.far = asyncio.run(bench_redis_far(server.url, 20_000))
            out.near = asyncio.run(bench_redis_near(server.url, 4.0, 64))
            out.one = asyncio.run(bench_redis_near(server.url, 2.0, 1))
            for n in (1, 3):
                if log:
                    log(f"state store: TPM accuracy, {n} replica(s), {seconds:.0f} s")
                out.accuracy[n] = accuracy(server.url, n, seconds)
        finally:
            server.stop()
    return out


def markdown(r: StateStoreResult) -> str:
    """The tables, with each Redis row's cost and rate also as a ratio to the in-process row."""
    far_us, far_rate, far_trips = r.far
    near_us, near_rate, near_ok, p50, p99, near_trips = r.near
    one_us, one_rate, _, one50, one99, _ = r.one

    def vs(us: float, rate: float) -> str:
        return f"{us / r.local_us:.1f}× / {rate / r.local_rate:.3f}×"

    lines = [
        "## TPM/RPM state: in-process vs Redis (bench.state_store)", "",
        "One process, a loopback `redis-server` started for the run; the ratios are to the in-process row "
        "measured in the same run.", "",
        "| state | µs CPU per decision (admit + settle) | decisions/s | vs in-process (cost / rate) | "
        "Redis round trips per decision | admit latency p50 / p99 |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| in-process (`memory`) | {r.local_us:.1f} | {r.local_rate:,.0f} | 1× / 1× | 0 | – |",
        f"| Redis, the lease covers (far from the limit), 1 client | {far_us:.1f} | {far_rate:,.0f} | "
        f"{vs(far_us, far_rate)} | {far_trips:.4f} | – |",
        f"| Redis, at the limit (no lease covers), 1 client | {one_us:.1f} | {one_rate:,.0f} | "
        f"{vs(one_us, one_rate)} | 1 | {one50:.2f} / {one99:.2f} ms |",
        f"| Redis, at the limit, 64 clients ({near_ok:,.0f} admitted/s) | {near_us:.1f} | {near_rate:,.0f} | "
        f"{vs(near_us, near_rate)} | {near_trips:.2f} | {p50:.2f} / {p99:.2f} ms |",
        "",
        f"TPM accuracy across replicas (separate processes on one Redis bucket, 64 clients in all, "
        f"{TPM // 60} tokens/s, B = {BURST}, {r.seconds:.0f} s):", "",
        "| replicas | worst 0.5/1/2 s window / (B + r·W) | steady consumption / TPM |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {n} | {worst:.3f} | {steady:.3f} |" for n, (worst, steady) in r.accuracy.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.state_store", description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each accuracy run")
    args = ap.parse_args(argv)
    print(markdown(run(args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
