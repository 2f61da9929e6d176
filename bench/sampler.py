"""Polls the backend (and Sluice, and a proxy's CPU) every ~250 ms while load runs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.stack import proc_cpu_rss


@dataclass
class Sample:
    t: float  # seconds since the run started
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions: int | None = None
    oom_failures: int | None = None
    admitted: int | None = None  # Sluice: slots in use on the main backend
    kv_reserved: int | None = None  # Sluice: worst-case KV footprints admitted
    scale: float | None = None  # Sluice: the watermark's capacity scale
    queued: int | None = None  # Sluice: requests waiting in its admission queue
    limit: int | None = None  # Sluice: the latency-driven concurrency limit, where an SLO is set
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds so far


@dataclass
class Sampler:
    engine_url: str  # the simulated backend's /admin/engine
    sluice_url: str | None = None  # extproc's /debug/state
    backend: str = "sim"  # which backend's slots to read from Sluice's state
    pids: dict[str, int] = field(default_factory=dict)  # processes whose CPU to follow
    interval: float = 0.25
    samples: list[Sample] = field(default_factory=list)

    async def _get(self, session: aiohttp.ClientSession, url: str) -> Any:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                if r.status == 200:
                    return await r.json(content_type=None)
        return None

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                s = Sample(time.monotonic() - t0)
                eng = await self._get(session, self.engine_url)
                if eng:
                    s.kv_usage, s.running, s.waiting = eng["kv_usage"], eng["running"], eng["waiting"]
                    s.preemptions, s.oom_failures = eng["preemptions_total"], eng["oom_failures_total"]
                if self.sluice_url:
                    st = await self._get(session, self.sluice_url)
                    be = (st or {}).get("backends", {}).get(self.backend)
                    if be:
                        s.admitted = be["slots"]["in_use"]
                        s.kv_reserved = be["kv"]["reserved_tokens"]
                        s.scale = be["scale"]
                        s.queued = sum(be["queue"]["depth"].values())
                        s.limit = (be.get("adaptive") or {}).get("limit")
                for name, pid in self.pids.items():
                    s.cpu[name] = proc_cpu_rss(pid)[0]
                self.samples.append(s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
