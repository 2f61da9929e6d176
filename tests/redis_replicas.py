"""RedisState replicas in one process on a real redis-server, and a load that drives them.

Time here is real (Redis ``TIME``), scaled down: small budgets, windows of seconds.
Several RedisState instances in one process are the replicas (each its own
connection, replica id and lease).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.redis_server import RedisServer
from extproc.policy.gate import Verdict
from extproc.policy.schema import Limits
from extproc.store.redis_state import RedisState

BURST, TPM = 1000, 60_000  # 1000 tokens/s, a bucket of one second
LIM = Limits(tpm=TPM, rpm=1_000_000, burst_tokens=BURST, max_concurrency=100)
RATE = TPM / 60.0


@pytest.fixture(name="server")
def server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own: outage tests freeze and kill it."""
    s = RedisServer(tmp_path / "redis").start()
    try:
        yield s
    finally:
        s.stop()


def replicas(url: str, n: int, prefix: str, **kw: object) -> list[RedisState]:
    return [RedisState(url, replica_id=f"r{i}", prefix=prefix, **kw) for i in range(n)]  # type: ignore[arg-type]


async def admit(state: RedisState, cost: int, limits: Limits = LIM, tenant: str = "t") -> Verdict:
    v = state.admit(tenant, limits, cost, time.monotonic())
    if not isinstance(v, Verdict):
        v = await v
    return v


@dataclass
class Load:
    """Concurrent clients on every replica: admit, hold ~5 ms, settle exactly; retry when refused."""

    states: list[RedisState]
    workers_per_state: int
    events: list[tuple[float, int, int, float]] = field(default_factory=list)  # (t, cost, replica, latency)
    refused: int = 0
    not_rate: list[str] = field(default_factory=list)
    decisions: list[tuple[float, float]] = field(default_factory=list)  # (called at, seconds to decide), all

    async def run(self, seconds: float, seed: int = 1) -> None:
        end = time.monotonic() + seconds
        rng = random.Random(seed)
        await asyncio.gather(*(self._worker(i, s, end, random.Random(rng.random()))
                               for i, s in enumerate(self.states) for _ in range(self.workers_per_state)))

    async def _worker(self, idx: int, state: RedisState, end: float, rng: random.Random) -> None:
        while time.monotonic() < end:
            cost = rng.randint(5, 25)
            t0 = time.monotonic()
            v = await admit(state, cost)
            t1 = time.monotonic()
            self.decisions.append((t0, t1 - t0))
            if v.admitted:
                self.events.append((t1, cost, idx, t1 - t0))
                await asyncio.sleep(0.005)
                state.settle("t", cost, cost, time.monotonic())
            else:
                if v.reason not in ("tpm", "rpm"):
                    self.not_rate.append(str(v.reason))
                self.refused += 1
                await asyncio.sleep(min(max(v.retry_after_s, 0.002), 0.05))

    def worst_window(self, w: float) -> float:
        """The most tokens admitted in any window of ``w`` seconds, over the contract for it.

        An admission was decided somewhere between the call and its return; a window
        counts those certainly decided inside it, so a busy event loop (late returns)
        cannot make the test fail or pass by itself.
        """
        ev = sorted((t1 - lat, t1, cost) for t1, cost, _, lat in self.events)
        worst = 0.0
        for i, (start, _, _) in enumerate(ev):
            total = 0
            for k in range(i, len(ev)):
                if ev[k][0] > start + w:
                    break
                if ev[k][1] <= start + w:
                    total += ev[k][2]
            worst = max(worst, total / (BURST + RATE * w))
        return worst

    def tokens(self, t0: float, t1: float, replica: int | None = None) -> int:
        return sum(c for t, c, r, _ in self.events if t0 <= t < t1 and (replica is None or r == replica))


async def close_all(states: list[RedisState]) -> None:
    for s in states:
        await s.aclose()
        await s.client.aclose()
