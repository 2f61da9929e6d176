"""What budget accounting costs per request, against the same run without budgets.

``python -m bench.budget_cost`` starts a throwaway ``redis-server`` on a random port and
prints one table: CPU microseconds of this process per request for the admission books
(TPM/RPM admit + settle; with a budget, the budget's admit + settle beside it), in
process and with Redis, each budgeted row against its own baseline measured in the same
run, rounds interleaved (a shared machine's noise lands on both alike):

- in process: ``LocalState`` alone, then with ``LocalBudgets``;
- Redis, far from the limits: ``RedisState`` alone (its lease covers), then with
  ``RedisBudgets`` admitting from its lease, then with every budget admission a round
  trip (``slice_fraction=0``, what a budget near its end costs);
- through a stream (``--stream``): a whole request through ``StreamProcessor`` (headers,
  body, response headers, trailers) with and without a budget, in process.

Ratios, not absolute numbers, are what to compare between machines.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.redis_server import RedisServer
from extproc.policy.budget import Amount, Budget
from extproc.policy.budget_ledger import BudgetVerdict, LocalBudgets
from extproc.policy.gate import LocalState, Verdict
from extproc.policy.schema import Limits
from extproc.store.budgets import RedisBudgets
from extproc.store.redis_state import RedisState

FAR = Limits(tpm=10**9, rpm=10**9, burst_tokens=10**9, max_concurrency=1000)
BUDGET = Budget(period="month", tokens=10**15, cost_nanos=10**15)
COST, ACTUAL = Amount(600, 60_000), Amount(320, 30_000)


REFUSED: dict[str, int] = {}  # refusals by reason: a store alarm on a loaded machine (the local share)


async def _tpm(state: Any, now: float) -> None:
    v = state.admit("t", FAR, COST.tokens, now)
    if not isinstance(v, Verdict):
        v = await v
    if not v.admitted:
        REFUSED[f"tpm {v.reason}"] = REFUSED.get(f"tpm {v.reason}", 0) + 1
        return
    state.settle("t", COST.tokens, ACTUAL.tokens, now)


async def _budget(books: Any, wall: float) -> None:
    v = books.admit("t", BUDGET, COST, wall)
    if not isinstance(v, BudgetVerdict):
        v = await v
    if not v.admitted or v.hold is None:
        REFUSED[f"budget {v.reason}"] = REFUSED.get(f"budget {v.reason}", 0) + 1
        return
    books.settle(v.hold, ACTUAL, wall)


def _round(n: int, step: Callable[[], Awaitable[None]], loop: asyncio.AbstractEventLoop) -> float:
    async def go() -> None:
        for _ in range(n):
            await step()

    t0 = time.process_time()
    loop.run_until_complete(go())
    return (time.process_time() - t0) / n * 1e6


def configs(url: str, loop: asyncio.AbstractEventLoop
            ) -> tuple[dict[str, Callable[[], Awaitable[None]]], list[Any]]:
    local, local_b = LocalState(), LocalBudgets()

    async def in_process() -> None:
        await _tpm(local, time.monotonic())

    async def in_process_budget() -> None:
        await _tpm(local, time.monotonic())
        await _budget(local_b, time.time())

    redis_t = RedisState(url, replica_id="bench-t", prefix="bench-t")
    redis_b = RedisState(url, replica_id="bench-b", prefix="bench-b")
    leased = RedisBudgets(redis_b)
    redis_d = RedisState(url, replica_id="bench-d", prefix="bench-d")
    direct = RedisBudgets(redis_d, slice_fraction=0.0)

    async def redis() -> None:
        await _tpm(redis_t, time.monotonic())

    async def redis_leased() -> None:
        await _tpm(redis_b, time.monotonic())
        await _budget(leased, time.time())

    async def redis_direct() -> None:
        await _tpm(redis_d, time.monotonic())
        await _budget(direct, time.time())

    return ({"in process": in_process, "in process + budget": in_process_budget, "Redis": redis,
             "Redis + budget (lease)": redis_leased, "Redis + budget (round trip each)": redis_direct},
            [leased, direct, redis_t, redis_b, redis_d])


BASELINE = {"in process + budget": "in process", "Redis + budget (lease)": "Redis",
            "Redis + budget (round trip each)": "Redis"}


def run(n: int, rounds: int, url: str) -> dict[str, list[float]]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    steps, closers = configs(url, loop)
    for step in steps.values():  # warm up: register, load scripts, first leases
        _round(max(50, n // 20), step, loop)
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            out[name].append(_round(n if not name.endswith("each)") else max(1, n // 5), step, loop))
    for c in closers:
        loop.run_until_complete(c.aclose())
    loop.close()
    return out


def stream_run(n: int, rounds: int) -> dict[str, list[float]]:
    """A whole request through StreamProcessor, in process, with and without a budget."""
    from bench.budget_stream import request_cost

    out: dict[str, list[float]] = {"stream": [], "stream + budget": []}
    for _ in range(rounds):
        out["stream"].append(request_cost(n, budget=False))
        out["stream + budget"].append(request_cost(n, budget=True))
    return out


def render(results: dict[str, list[float]], baselines: dict[str, str]) -> str:
    lines = ["| books | CPU µs per request (median of rounds) | against | added µs | ratio |",
             "| --- | --- | --- | --- | --- |"]
    med = {k: statistics.median(v) for k, v in results.items()}
    for name, us in med.items():
        base = baselines.get(name)
        if base is None:
            lines.append(f"| {name} | {us:.1f} | – | – | 1.00 |")
        else:
            lines.append(f"| {name} | {us:.1f} | {base} | {us - med[base]:+.1f} | {us / med[base]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="requests per round (a fifth for the round-trip row)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream", action="store_true", help="also a whole request through StreamProcessor")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d) / "redis").start()
        try:
            results = run(a.n, a.rounds, server.url)
        finally:
            server.stop()
    print(render(results, BASELINE))
    if a.stream:
        print()
        print(render(stream_run(max(1, a.n // 5), a.rounds), {"stream + budget": "stream"}))
    print(f"\n{a.rounds} interleaved rounds of {a.n} requests; CPU time of this process (Redis's own excluded). "
          "Ratios are against the row's baseline measured in the same run."
          + (f" Refused (store alarms on a loaded machine: the local share): {REFUSED}" if REFUSED else ""))


if __name__ == "__main__":
    main()
