"""Floods of refusals beside a premium tenant: does premium keep its latency?

    python -m bench.floods [--quick] [--seconds 15] [--connections 1000]

Two floods, each from 1,000 keep-alive connections of its own client address, as fast as
they are answered:

- ``unknown keys``: a made-up key of the right shape, new on every request (401 from Sluice,
  or 429 ``edge_rate_limited`` from Envoy once the address is over ``edge.source_rps``);
- ``refused tenant``: one valid free-tier key far over its RPM (429 from Sluice, or from
  Envoy once the key is over the fastest rate any tier may go).

Premium (127.0.0.1) sends small non-streaming chats at a fixed rate, open loop, alone and
during each flood. Two configurations of the same stack: ``edge off`` (no per-key or
per-address limits: every refusal is a round trip to Sluice) and ``edge on`` (the policy's
``gateway.edge``). CPU of Envoy, extproc and the flood's own client process comes from
/proc over each phase. Every number is measured in this run, against premium alone in the
same configuration: the target is premium p99 during a flood within 2x alone + 50 ms.
The machine is shared: the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.metrics import pct
from bench.report import table, verdict
from bench.stack import Gateway, Ports, envoy_config, envoy_options, proc_cpu_rss, write_policy
from extproc.envoy.bootstrap import BackendRoute
from extproc.policy.edge import EdgeLimits, edge_limits
from extproc.policy.schema import build_policy, hash_key

CHAT = "/v1/chat/completions"
PREMIUM, FREE = "sk-flood-premium-0001", "sk-flood-free-0001"
PREMIUM_ADDR, FLOOD_ADDRS = (
    "127.0.0.1",
    {"unknown keys": "127.0.0.2", "refused tenant": "127.0.0.3"},
)
PREMIUM_RPS = 20.0


def policy(sim_port: int, source_rps: float) -> dict[str, Any]:
    return {
        "gateway": {
            "max_connections": 8192,
            "default_max_tokens": 16,
            "edge": {"source_rps": source_rps, "source_burst": int(2 * source_rps)},
        },
        "backends": [
            {
                "name": "sim",
                "address": f"127.0.0.1:{sim_port}",
                "max_concurrency": 64,
                "models": [{"name": "sim-llama-8b", "context_window": 8192}],
            }
        ],
        "tiers": {
            "premium": {"priority": 100, "tpm": 10_000_000, "rpm": 6000, "max_concurrency": 64},
            "free": {"priority": 10, "tpm": 20_000, "rpm": 60, "max_concurrency": 8},
        },
        "tenants": [
            {"name": "premium", "tier": "premium", "keys": [hash_key(PREMIUM)]},
            {"name": "free", "tier": "free", "keys": [hash_key(FREE)]},
        ],
    }


BODY = json.dumps(
    {
        "model": "sim-llama-8b",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello there"}],
    }
).encode()


async def _post(
    s: aiohttp.ClientSession, url: str, key: str, extra: dict[str, str] | None = None
) -> tuple[int, str]:
    """One small chat with ``key``: (status, x-sluice-reason)."""
    headers = {
        "authorization": f"Bearer {key}",
        "content-type": "application/json",
        **(extra or {}),
    }
    async with s.post(url + CHAT, data=BODY, headers=headers) as r:
        await r.read()
        return r.status, r.headers.get("x-sluice-reason", "")


# ---- the flood, in a process of its own -------------------------------------------------
def _flood_main(url: str, kind: str, addr: str, connections: int, seconds: float, out: Any) -> None:
    os.nice(
        int(os.environ.get("FLOOD_NICE", "5"))
    )  # the attacker's machine is not the gateway's: give the gateway's processes the CPU first
    out.put(asyncio.run(_flood(url, kind, addr, connections, seconds)))


async def _flood(
    url: str, kind: str, addr: str, connections: int, seconds: float
) -> dict[str, Any]:
    codes: Counter[str] = Counter()
    stop = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=connections, local_addr=(addr, 0))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one() -> None:
            rng = random.Random()
            while time.monotonic() < stop:
                key = f"sk-bogus-{rng.getrandbits(64):016x}" if kind == "unknown keys" else FREE
                try:
                    status, reason = await _post(s, url, key)
                    codes[f"{status} {reason}"] += 1
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    codes[type(exc).__name__] += 1

        await asyncio.gather(*(one() for _ in range(connections)))
    return {"codes": dict(codes), "cpu_s": time.process_time()}


# ---- premium, in this process -------------------------------------------------------------
async def premium(url: str, seconds: float) -> list[float]:
    """Latencies (s) of premium's 200s, sent at PREMIUM_RPS open loop."""
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=64, local_addr=(PREMIUM_ADDR, 0))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one() -> None:
            t0 = time.monotonic()
            status, _ = await _post(s, url, PREMIUM, {"x-sim-tokens": "4"})
            if status == 200:
                lat.append(time.monotonic() - t0)

        tasks, t0 = [], time.monotonic()
        for i in range(int(seconds * PREMIUM_RPS)):
            await asyncio.sleep(max(0.0, t0 + i / PREMIUM_RPS - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks, return_exceptions=True)
    return lat


@dataclass
class Phase:
    config: str
    flood: str  # "alone" or a flood's name
    premium_ms: list[float] = field(default_factory=list)
    premium_sent: int = 0
    flood_codes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # process -> share of one core

    def p(self, q: float) -> float:
        return pct(self.premium_ms, q)

    @property
    def flood_rps(self) -> float:
        return sum(self.flood_codes.values()) / self.seconds if self.seconds else 0.0

    @property
    def reached_sluice_rps(self) -> float:
        """Flood requests that cost a round trip to extproc (not refused by Envoy)."""
        n = sum(v for k, v in self.flood_codes.items() if "edge_rate_limited" not in k)
        return n / self.seconds if self.seconds else 0.0


def run_phase(gw: Gateway, config: str, flood: str, seconds: float, connections: int) -> Phase:
    ph = Phase(config, flood, seconds=seconds)
    pids = {"envoy": gw.procs["envoy"].pid, "extproc": gw.procs["extproc"].pid}
    before = {k: proc_cpu_rss(p)[0] for k, p in pids.items()}
    out: Any = None
    proc = None
    if flood != "alone":
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(
            target=_flood_main,
            args=(gw.url, flood, FLOOD_ADDRS[flood], connections, seconds + 1.0, out),
        )
        proc.start()
        time.sleep(1.0)  # the flood's connections open first: premium measures the steady state
        before = {k: proc_cpu_rss(p)[0] for k, p in pids.items()}
    t0 = time.monotonic()
    lat = asyncio.run(premium(gw.url, seconds))
    wall = time.monotonic() - t0
    ph.cpu = {k: (proc_cpu_rss(p)[0] - before[k]) / wall for k, p in pids.items()}
    ph.premium_ms = [x * 1000 for x in lat]
    ph.premium_sent = int(seconds * PREMIUM_RPS)
    if proc is not None:
        got = out.get(timeout=120)
        proc.join(30)
        ph.flood_codes = got["codes"]
        ph.cpu["flood client"] = got["cpu_s"] / (seconds + 1.0)
    return ph


def run(
    workdir: Path, seconds: float = 15.0, connections: int = 1000, log: Any = print
) -> list[Phase]:
    phases: list[Phase] = []
    for config, source_rps in (("edge off", 0.0), ("edge on", 50.0)):
        gw = Gateway(workdir / config.replace(" ", "-"), Ports())
        try:
            gw.start_sim("sim", gw.ports.sim, ["--time-scale", "1"])
            doc = policy(gw.ports.sim, source_rps)
            policy_dir = write_policy(gw.workdir / "policies", doc)
            gw.start_extproc(policy_dir)
            edge = edge_limits(build_policy(doc)) if config == "edge on" else EdgeLimits()
            opts = replace(envoy_options(gw.ports, doc), edge=edge, max_connections=8192)
            gw.start_envoy(
                envoy_config("sluice", [BackendRoute("sim", "127.0.0.1", gw.ports.sim)], opts),
                config,
            )
            for flood in ("alone", "unknown keys", "refused tenant"):
                log(f"floods: {config}, {flood} ({seconds:.0f} s)")
                phases.append(run_phase(gw, config, flood, seconds, connections))
        finally:
            gw.stop()
    return phases


def markdown(phases: list[Phase], connections: int) -> str:
    alone = {p.config: p for p in phases if p.flood == "alone"}
    rows = []
    for p in phases:
        a = alone[p.config]
        target = 2 * a.p(0.99) + 50
        rows.append(
            [
                p.config,
                p.flood,
                f"{len(p.premium_ms)}/{p.premium_sent}",
                f"{p.p(0.5):.1f}",
                f"{p.p(0.99):.1f}",
                "–" if p.flood == "alone" else f"{target:.0f}",
                "–"
                if p.flood == "alone"
                else verdict(p.p(0.99) <= target and len(p.premium_ms) == p.premium_sent),
                f"{p.flood_rps:,.0f}" if p.flood != "alone" else "–",
                f"{p.reached_sluice_rps:,.0f}" if p.flood != "alone" else "–",
                f"{p.cpu.get('envoy', math.nan):.0%}",
                f"{p.cpu.get('extproc', math.nan):.0%}",
                f"{p.cpu['flood client']:.0%}" if "flood client" in p.cpu else "–",
            ]
        )
    codes = "; ".join(
        f"{p.config} / {p.flood}: "
        + ", ".join(f"{k} x{v:,}" for k, v in sorted(p.flood_codes.items(), key=lambda kv: -kv[1]))
        for p in phases
        if p.flood_codes
    )
    return "\n".join(
        [
            "## Floods of refusals beside premium (bench.floods)",
            "",
            f"Premium: {PREMIUM_RPS:.0f} small non-streaming chats/s from {PREMIUM_ADDR}; "
            f"each flood: {connections:,} keep-alive connections from an address of its own, as "
            "fast as answered (its client at nice 5). Latency in ms; CPU as a share of one core "
            "over the phase. Target: premium p99 <= 2x alone + 50 ms, "
            "alone measured in the same run and configuration. "
            f"Load average at the end: {' '.join(open('/proc/loadavg').read().split()[:3])}.",
            "",
            table(
                [
                    "config",
                    "phase",
                    "premium 200s",
                    "p50",
                    "p99",
                    "target p99",
                    "verdict",
                    "flood req/s",
                    "reached extproc /s",
                    "Envoy CPU",
                    "extproc CPU",
                    "flood client CPU",
                ],
                rows,
            ),
            "",
            f"Flood answers: {codes}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.floods", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="6 s phases, 300 connections")
    args = ap.parse_args(argv)
    seconds, connections = (6.0, 300) if args.quick else (args.seconds, args.connections)
    with tempfile.TemporaryDirectory(prefix="sluice-floods-") as tmp:
        phases = run(
            Path(tmp),
            seconds,
            connections,
            log=lambda m: print(
                f"[floods {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True
            ),
        )
    print(markdown(phases, connections))


if __name__ == "__main__":
    main()
