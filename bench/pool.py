"""A pool of three simulated engines of different KV sizes under the conversation trace's
busiest stretch at 3x: who places the requests?

    python -m bench.pool [--quick] [--configs round_robin,least_request,sluice,sluice_prefix] [--workdir DIR]

Traffic: the densest window of Azure's conversation trace (``bench.trace_window``),
replayed with its gaps divided by 3 (arrivals at 3x the trace's rate there), prompt and
completion sizes as in the trace, dealt 15 % premium / 85 % free; the prompts' text is
conversation-shaped (``bench.conversations``: shared system prompts, next turns repeating
the previous one), and every engine caches prefixes (``--enable-prefix-caching``). Every
configuration gets the same requests, byte for byte, through the same Sluice admission
(two tiers, one budget: the sum of the three engines') and the real Envoy; only the
placement differs:

- ``round_robin``: Envoy's ROUND_ROBIN over a STATIC cluster of the three (Sluice sees one
  backend of the summed size and does not place);
- ``least_request``: Envoy's LEAST_REQUEST over them;
- ``sluice``: the backend is a pool (``endpoints:``); Sluice places each request
  (``extproc.policy.placement``) and Envoy's EDS cluster follows ``x-sluice-endpoint``;
- ``sluice_prefix``: as ``sluice`` plus ``placement: {prefix_affinity: true}``;
- ``sluice_prefix_sticky`` (only when asked for with ``--configs``): as ``sluice_prefix``
  with ``affinity_min_headroom: 0``.

A configuration whose policy the schema refuses, or whose engine flags the simulated
engine lacks, or that is ``Placement.blocked``, is reported as not run.

Capacity, measured first in the same run: the same three engines behind Sluice picking,
fed a saturating closed loop of the same mix (1.5x the clients whose mean KV footprint
fills the three caches), completion tokens/s of finished requests after a warm-up (the
loop goes on saturating a few seconds past the measured part, so its last streams finish).
Goodput is the same measure (completion tokens of requests that finished OK, spread over
their streaming) during the burst's arrivals after the same warm-up.

Per configuration: preemptions, KV peak and mean per engine, goodput and its share of
the capacity, premium TTFT p50/p99 (client-measured, queueing included), outcomes (429,
503, other failures), ratios against the first configuration run (round-robin), each
engine's prefix cache hit rate (hit / queried prompt tokens, as vLLM's
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``) and Sluice's
``sluice_prefix_affinity_total{result}`` (hit / spill / miss, from ``/debug/state``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.conversations import Conversations
from bench.loadgen import ClientPolicy, OpenLoop, Result, closed_loop, new_session, send
from bench.metrics import pct, tier_stats, tokens_between
from bench.procs import Proc, envoy_binary, free_port, get_json, wait_http, wait_idle
from bench.stack import extproc_proc, sim_proc
from bench.trace import (
    CHAT_MODEL,
    CHAT_WINDOW,
    Mix,
    Request,
    load_trace,
    mean_kv_tokens,
    sample_mix,
)
from bench.trace_window import burst_schedule, densest_window, mean_between, ratio
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, render_bootstrap
from extproc.envoy.eds import write_policy
from extproc.policy.schema import build_policy, hash_key

BLOCK = 16
ENGINES = (512, 1024, 2048)  # KV blocks: 8,192, 16,384 and 32,768 tokens
SEQS = 64
SLOTS = 32  # Sluice's slots per engine
KEYS = {"premium": "sk-bench-pool-premium", "free": "sk-bench-pool-free"}
MIX = Mix(premium_share=0.15, batch_share=0.0)  # premium alone offers ~0.6x the capacity in the burst
CLIENTS = {"premium": ClientPolicy(15, 120), "free": ClientPolicy(15, 120)}
COMPRESS = 3.0
# The engines schedule as vLLM V1 does: prompts prefilled in 2,048-token chunks mixed with decode,
# and cache prefixes as vLLM V1 does by default, in every configuration: only placement differs.
SIM_EXTRA = ("--chunked-prefill", "--max-num-batched-tokens", "2048", "--enable-prefix-caching")
CAPACITY_RATE = 8.0  # req/s: the capacity loop's requests get arrival times this far apart for
# the conversation model (its turn gaps); about the rate the closed loop gets through them
CAPACITY_REQUESTS = 3000  # far more than the capacity loop sends


@dataclass(frozen=True)
class Placement:
    title: str
    lb: str | None  # Envoy's lb_policy over a STATIC cluster of the engines; None: Sluice places
    backend: dict[str, Any] = field(default_factory=dict)  # merged into the pool backend
    sim: tuple[str, ...] = ()  # more simulated-engine flags
    blocked: str | None = None  # what else it needs before its numbers mean anything


PLACEMENTS: dict[str, Placement] = {
    "round_robin": Placement("Envoy round-robin", "ROUND_ROBIN"),
    "least_request": Placement("Envoy least-request", "LEAST_REQUEST"),
    "sluice": Placement("Sluice picking", None),
    # Prefix affinity: the engines cache prefixes in every configuration.
    "sluice_prefix": Placement("Sluice picking + prefix affinity", None, {"placement": {"prefix_affinity": True}}),
    # Not run by default: affinity without its headroom rule (the preferred endpoint wins
    # whenever the request fits there), to see what the rule costs in cache hits.
    "sluice_prefix_sticky": Placement("Sluice picking + prefix affinity, min headroom 0", None,
                                      {"placement": {"prefix_affinity": True, "affinity_min_headroom": 0.0}}),
}
CONFIGS = ("round_robin", "least_request", "sluice", "sluice_prefix")  # the default run


@dataclass(frozen=True)
class Sizing:
    window_s: float  # trace seconds replayed (wall time: window_s / COMPRESS)
    capacity_s: float  # the capacity closed loop's measured part
    capacity_tail_s: float  # it keeps saturating this much longer, so streams in flight at its end count
    warm_s: float  # excluded from goodput at the start of both
    drain_s: float  # how long stragglers may finish after the last arrival
    time_scale: float = 1.0


FULL = Sizing(window_s=90, capacity_s=20, capacity_tail_s=6, warm_s=5, drain_s=15)
QUICK = Sizing(window_s=15, capacity_s=5, capacity_tail_s=2, warm_s=2, drain_s=3)


def sim_args(blocks: int, placement: Placement, time_scale: float) -> list[str]:
    return ["--kv-blocks", str(blocks), "--block-size", str(BLOCK), "--max-num-seqs", str(SEQS),
            "--max-model-len", str(CHAT_WINDOW), "--time-scale", str(time_scale), *SIM_EXTRA, *placement.sim]


def policy(ports: list[int], placement: Placement) -> dict[str, Any]:
    caps = [b * BLOCK for b in ENGINES]
    backend: dict[str, Any] = {"name": "sim", "kv_block_size": BLOCK, "max_concurrency": SLOTS,
                               "watermark": {"scrape_interval_s": 0.2},
                               "breaker": {"trip_on_preemption": False},
                               "models": [{"name": CHAT_MODEL, "context_window": CHAT_WINDOW}]}
    if placement.lb is None:
        backend["endpoints"] = [{"address": f"127.0.0.1:{p}", "metrics_url": f"http://127.0.0.1:{p}/metrics",
                                 "kv_capacity_tokens": c} for p, c in zip(ports, caps, strict=True)]
        backend.update(placement.backend)
    else:
        # The same budget, but Envoy places: Sluice sees one backend of the summed size.
        backend.update(address=f"127.0.0.1:{ports[0]}", kv_capacity_tokens=sum(caps),
                       max_concurrency=SLOTS * len(ports))
    tier = {"tpm": 100_000_000, "rpm": 1_000_000}
    return {"gateway": {"max_body_bytes": 1 << 20, "message_timeout_ms": 5000},
            "backends": [backend],
            "tiers": {"premium": {**tier, "priority": 100, "max_queue_wait_ms": 10_000, "max_queue_depth": 512,
                                  "queue_weight": 4},
                      "free": {**tier, "priority": 10, "max_queue_wait_ms": 3_000, "max_queue_depth": 256,
                               "queue_weight": 1}},
            "tenants": [{"name": f"{t}-tenant", "tier": t, "keys": [hash_key(k)]} for t, k in KEYS.items()]}


def unavailable(placement: Placement) -> str | None:
    """Why ``placement`` cannot run with this checkout (its policy or engine flags unknown)."""
    try:
        build_policy(policy([1, 2, 3], placement))
    except ValueError as exc:
        fields = ", ".join(f"`{k}`" for k in placement.backend) or "its policy"
        return f"the policy schema refuses {fields} ({str(exc).splitlines()[0][:100]})"
    from bench.simbackend.__main__ import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    missing = [f for f in (*SIM_EXTRA, *placement.sim) if f.startswith("--") and f not in known]
    if missing:
        return f"the simulated engine has no {', '.join(missing)}"
    return f"it needs {placement.blocked}" if placement.blocked else None


def envoy_config(doc: dict[str, Any], ports: list[int], lb: str | None, listen: int, admin: int, grpc: int,
                 drain: int, eds_dir: Path) -> dict[str, Any]:
    """Sluice picking (lb None): the pool's EDS cluster, its endpoint file written to ``eds_dir``
    from the policy; else the same cluster with STATIC endpoints balanced by Envoy's ``lb``."""
    policy = build_policy(doc)
    opts = EnvoyOptions(listen_port=listen, admin_port=admin, extproc_port=grpc, drain_port=drain,
                        eds_dir=str(eds_dir), **policy_options(policy))  # type: ignore[arg-type]
    cfg = render_bootstrap([BackendRoute("sim", "127.0.0.1", ports[0], pool=True)], opts)
    if lb is None:
        write_policy(eds_dir, policy)
    else:  # the same cluster (usage filters included), balanced by Envoy instead
        c = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "sim")
        for k in ("eds_cluster_config", "load_balancing_policy"):
            c.pop(k, None)
        c.update(type="STATIC", lb_policy=lb, load_assignment={"cluster_name": "sim", "endpoints": [{
            "lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                          "port_value": p}}}} for p in ports]}]})
    return cfg


@dataclass
class Run:
    name: str
    title: str
    results: list[Result] = field(default_factory=list)
    kv: list[list[tuple[float, float]]] = field(default_factory=list)  # per engine: (t, kv_usage)
    engines: list[dict[str, Any]] = field(default_factory=list)  # /admin/engine at the end
    window: tuple[float, float] = (0.0, 0.0)  # where goodput and KV means are measured
    seconds: float = 0.0
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    state: list[dict[str, Any]] = field(default_factory=list)  # Sluice's queue and endpoints' room, sampled
    affinity: dict[str, int] | None = None  # sluice_prefix_affinity_total by result at the end; None: off

    def prefix_hit_rates(self) -> list[float]:
        """Per engine, then all together: prefix cache hit tokens / queried tokens (nan: none)."""
        pcs = [e.get("prefix_cache") or {} for e in self.engines]
        pairs = [(c.get("hits_tokens", 0), c.get("queries_tokens", 0)) for c in pcs]
        pairs.append((sum(h for h, _ in pairs), sum(q for _, q in pairs)))
        return [h / q if q else math.nan for h, q in pairs]

    @property
    def goodput(self) -> float:
        a, b = self.window
        return tokens_between(self.results, a, b) / (b - a) if b > a else math.nan

    def _premium_ok(self) -> list[Result]:
        return [r for r in self.results if r.tier == "premium" and r.ok and r.first is not None and r.head is not None]

    def premium_ttft(self, q: float) -> float:
        return pct((r.first - r.sent for r in self._premium_ok()), q)  # type: ignore[operator]

    def premium_wait(self, q: float) -> float:
        """Until the response headers: Sluice's queue (the engine answers headers at once)."""
        return pct((r.head - r.sent for r in self._premium_ok()), q)  # type: ignore[operator]

    def premium_engine(self, q: float) -> float:
        return pct((r.first - r.head for r in self._premium_ok()), q)  # type: ignore[operator]


@dataclass
class Stack:
    """Three engines, extproc and Envoy for one placement, on free ports."""

    workdir: Path
    placement: Placement
    time_scale: float
    ports: list[int] = field(default_factory=lambda: [free_port() for _ in ENGINES])
    grpc: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)
    listen: int = field(default_factory=free_port)
    envoy_admin: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen}"

    @property
    def state_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}/debug/state"

    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}/admin/engine" for p in self.ports]

    def __enter__(self) -> Stack:
        d = self.workdir
        d.mkdir(parents=True, exist_ok=True)
        doc = policy(self.ports, self.placement)
        (d / "policy").mkdir(exist_ok=True)
        (d / "policy" / "policy.yaml").write_text(yaml.safe_dump(doc))
        (d / "envoy.yaml").write_text(yaml.safe_dump(envoy_config(
            doc, self.ports, self.placement.lb, self.listen, self.envoy_admin, self.grpc, self.admin, d / "eds")))
        # All at once (none needs another to start), then each waited for: engines, extproc, Envoy.
        ready = [f"http://127.0.0.1:{p}/health" for p in self.ports] + [
            f"http://127.0.0.1:{self.admin}/healthz", f"http://127.0.0.1:{self.envoy_admin}/ready"]
        try:
            for p, blocks in zip(self.ports, ENGINES, strict=True):
                self.procs.append(sim_proc(d, f"sim-{blocks * BLOCK // 1024}k", p,
                                           sim_args(blocks, self.placement, self.time_scale)).start())
            self.procs.append(extproc_proc(d, d / "policy", self.grpc, self.admin).start())
            self.procs.append(Proc("envoy", [envoy_binary(), "-c", str(d / "envoy.yaml"), "--disable-hot-restart",
                                             "-l", "warning", "--concurrency", "1"], d / "envoy.log").start())
            for url, proc in zip(ready, self.procs, strict=True):
                wait_http(url, proc=proc.popen)
            asyncio.run(self._warm_up())
        except BaseException:
            self.stop()
            raise
        return self

    async def _warm_up(self) -> None:
        """One tiny request per tier (first-request costs paid, first scrapes in)."""
        async with new_session() as s:
            for tier, key in KEYS.items():
                await send(s, self.url, key, Request(-1, 0.0, "warmup", tier, CHAT_MODEL, 16, 4, 2),
                           time.monotonic(), ClientPolicy(30, 30))
        await asyncio.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def sample_kv(urls: list[str], t0: float, stop: asyncio.Event, out: list[list[tuple[float, float]]],
                    state_url: str | None = None, state: list[dict[str, Any]] | None = None,
                    interval: float = 0.25) -> None:
    """Every ``interval``: each engine's KV usage, as (seconds since t0, fraction); with
    ``state_url``, also Sluice's queue depths and each pool endpoint's KV room (capacity x
    scale - reserved, tokens) into ``state`` (kept in results.json, for reading a run)."""
    out[:] = [[] for _ in urls]
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for i, u in enumerate(urls):
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with session.get(u, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                        out[i].append((time.monotonic() - t0, (await r.json())["kv_usage"]))
            if state_url and state is not None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                    async with session.get(state_url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                        be = (await r.json())["backends"]["sim"]
                    state.append({"t": time.monotonic() - t0, "queue": be["queue"]["depth"],
                                  "room": [round(e["kv"]["capacity_tokens"] * e["scale"] - e["kv"]["reserved_tokens"])
                                           for e in be.get("endpoints") or []]})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


def _finish(run: Run, stack: Stack) -> None:
    run.engines = [get_json(u) for u in stack.engine_urls()]
    (stack.workdir / "results.json").write_text(json.dumps(
        {"results": [dataclasses.asdict(r) for r in run.results], "kv": run.kv, "engines": run.engines,
         "sluice": run.state}))
    end = wait_idle(stack.state_url, 10)
    aff = end["backends"]["sim"].get("prefix_affinity")
    run.affinity = None if aff is None else {k: aff.get(k, 0) for k in ("hit", "spill", "miss")}
    led = end["ledger"]
    run.notes.append(f"after the run: Sluice in flight {end['in_flight']}, ledger balanced {led['balanced']}")


def measure_capacity(workdir: Path, size: Sizing, log: Callable[[str], None]) -> Run:
    """Sluice picking over the three engines, saturated by a closed loop of the same mix."""
    rows = load_trace()
    reqs = sample_mix(rows, 20000, MIX, seed=3)
    workers = math.ceil(1.5 * sum(ENGINES) * BLOCK / mean_kv_tokens(reqs))
    reqs = [dataclasses.replace(r, at=i / CAPACITY_RATE) for i, r in enumerate(reqs[:CAPACITY_REQUESTS])]
    convs = Conversations(reqs)
    run = Run("capacity", f"capacity: Sluice picking, closed loop of {workers} clients",
              window=(size.warm_s, size.capacity_s), seconds=size.capacity_s)
    log(f"pool capacity: {workers} closed-loop clients for {size.capacity_s:.0f} s")
    with Stack(workdir / "capacity", PLACEMENTS["sluice"], size.time_scale) as stack:
        async def drive() -> list[Result]:
            stop = asyncio.Event()
            t0 = time.monotonic()
            kv = asyncio.create_task(sample_kv(stack.engine_urls(), t0, stop, run.kv))
            try:
                return await closed_loop(
                    stack.url, KEYS, iter(reqs), workers, size.capacity_s + size.capacity_tail_s, t0, body=convs.body
                )
            finally:
                stop.set()
                await kv
        run.results = asyncio.run(drive())
        _finish(run, stack)
    return run


def run_config(name: str, workdir: Path, reqs: list[Request], bodies: dict[int, bytes], size: Sizing,
               log: Callable[[str], None]) -> Run:
    placement = PLACEMENTS[name]
    arrivals = max(r.at for r in reqs)
    run = Run(name, placement.title, window=(size.warm_s, arrivals))
    why = unavailable(placement)
    if why:
        run.error = f"not run: {why}"
        log(f"{placement.title}: {run.error}")
        return run
    log(f"{placement.title}: {len(reqs)} requests over {arrivals:.0f} s")
    try:
        with Stack(workdir / name, placement, size.time_scale) as stack:
            async def drive() -> list[Result]:
                stop = asyncio.Event()
                t0 = time.monotonic() + 0.2
                kv = asyncio.create_task(sample_kv(stack.engine_urls(), t0, stop, run.kv, stack.state_url, run.state))
                try:
                    return await OpenLoop(stack.url, KEYS, CLIENTS, drain_s=size.drain_s,
                                          body=lambda r: bodies[r.id]).run(reqs, t0)
                finally:
                    stop.set()
                    await kv
            t = time.monotonic()
            run.results = asyncio.run(drive())
            run.seconds = time.monotonic() - t
            _finish(run, stack)
    except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is reported, not fatal
        run.error = f"{type(exc).__name__}: {exc}"
        log(f"{placement.title} failed: {run.error}")
    return run


@dataclass
class PoolBench:
    capacity: Run
    runs: dict[str, Run]
    requests: list[Request]
    trace_start_s: float
    size: Sizing
    conversations: dict[str, float] = field(default_factory=dict)  # Conversations.summary() of the burst

    @property
    def capacity_tok_s(self) -> float:
        return self.capacity.goodput

    @property
    def capacity_rps(self) -> float:
        a, b = self.capacity.window
        return sum(1 for r in self.capacity.results if r.ok and r.end is not None and a <= r.end < b) / (b - a)


def run(workdir: Path, *, quick: bool = False, configs: str = ",".join(CONFIGS),
        log: Callable[[str], None] = print) -> PoolBench:
    size = QUICK if quick else FULL
    rows = load_trace()
    start = densest_window(rows, size.window_s)
    reqs = burst_schedule(rows, start, size.window_s, COMPRESS, MIX)
    log(f"trace window: {size.window_s:.0f} s from {rows[start].t:.0f} s (the densest), {len(reqs)} arrivals, "
        f"replayed {COMPRESS:.0f}x faster")
    convs = Conversations(reqs)
    bodies = {r.id: convs.body(r) for r in reqs}  # built before the clock starts, the same for all
    summary = convs.summary()
    log("prompts: {conversations:.0f} conversations, {follow_ups:.0%} of requests are follow-up turns, "
        "{with_system:.0%} carry a system prompt, {shared_tokens:.0%} of prompt tokens precede the last user turn"
        .format(**summary))
    cap = measure_capacity(workdir, size, log)
    log(f"pool capacity: {cap.goodput:.0f} completion tok/s")
    runs = {name: run_config(name, workdir, reqs, bodies, size, log) for name in configs.split(",") if name}
    return PoolBench(cap, runs, reqs, rows[start].t, size, summary)


def _f(x: float, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _per_engine(xs: list[str]) -> str:
    return " / ".join(xs)


def markdown(b: PoolBench) -> str:
    cap = b.capacity
    arrivals = max(r.at for r in b.requests)
    prem = sum(1 for r in b.requests if r.tier == "premium")
    offered_rps = len(b.requests) / arrivals
    sizes = "/".join(f"{e * BLOCK // 1024}k" for e in ENGINES)
    out = [
        f"Three simulated engines ({sizes} tokens of KV, {SEQS} sequences each, time scale {b.size.time_scale:g}); "
        f"traffic: the conversation trace's densest {b.size.window_s:.0f} s (from {b.trace_start_s:.0f} s), "
        f"{COMPRESS:.0f}x compressed: {len(b.requests)} requests in {arrivals:.0f} s ({offered_rps:.1f} req/s, "
        f"{prem} premium, {len(b.requests) - prem} free).",
        "",
        *([f"Prompts (`bench.conversations`, the same bytes in every configuration; every engine caches prefixes): "
           f"{c['conversations']:.0f} conversations, {100 * c['follow_ups']:.0f} % of requests are follow-up turns, "
           f"{100 * c['with_system']:.0f} % carry one of the shared system prompts, "
           f"{100 * c['shared_tokens']:.0f} % of prompt tokens precede the request's last user turn.", ""]
          if (c := b.conversations) else []),
        f"Capacity (same run): Sluice picking fed a saturating closed loop of the same mix: "
        f"**{cap.goodput:.0f} completion tok/s**, {b.capacity_rps:.2f} req/s (offered in the burst: "
        f"{_f(ratio(offered_rps, b.capacity_rps), '{:.1f}')}x), preemptions "
        f"{_per_engine([str(e.get('preemptions_total', '?')) for e in cap.engines])}, prefix cache hits "
        f"{_f(100 * cap.prefix_hit_rates()[-1], '{:.0f}')} % of prompt tokens. Goodput: completion tokens/s "
        f"of requests that finished OK, {b.size.warm_s:.0f} s to {arrivals:.0f} s (the arrivals after a warm-up). "
        f"Unfinished: still streaming {b.size.drain_s:.0f} s after the last arrival (cut); other: client "
        f"timeouts and transport errors. Ratios (x) against the first row. Prefix cache hit %: prompt tokens the "
        f"engine found cached / prompt tokens it was asked for (per engine, then all); affinity: Sluice's "
        f"placements by prefix affinity (hit / spill / miss).",
        "",
        f"| placement | preemptions ({sizes}) | KV peak % | KV mean % | goodput tok/s | % of capacity | "
        "goodput x | premium TTFT p50 / p99 s | p99 x | premium ok | free ok | 429 / 503 / unfinished / other | "
        f"prefix cache hit % ({sizes} / all) | affinity hit / spill / miss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base: Run | None = None
    notes: list[str] = []
    for run in b.runs.values():
        if run.error:
            out.append(f"| {run.title} | {run.error.split(' (')[0]} |" + " |" * 12)
            continue
        base = base or run
        a, w = run.window
        pre = _per_engine([str(e["preemptions_total"]) for e in run.engines])
        peak = _per_engine([f"{100 * e['kv_blocks_peak'] / e['kv_blocks_total']:.0f}" for e in run.engines])
        mean = _per_engine([_f(100 * mean_between(s, a, w), "{:.0f}") for s in run.kv])
        st = {t: tier_stats([r for r in run.results if r.tier == t]) for t in KEYS}
        s429 = sum(s.rejected_429 for s in st.values())
        s503 = sum(s.rejected_503 for s in st.values())
        unfinished = sum(s.unfinished for s in st.values())
        other = sum(s.other_errors + s.gave_up for s in st.values())
        out.append(
            f"| {run.title} | {pre} | {peak} | {mean} | {run.goodput:.0f} | "
            f"{_f(100 * ratio(run.goodput, b.capacity_tok_s), '{:.0f}')} | "
            f"{_f(ratio(run.goodput, base.goodput))} | {_f(run.premium_ttft(0.5))} / {_f(run.premium_ttft(0.99))} | "
            f"{_f(ratio(run.premium_ttft(0.99), base.premium_ttft(0.99)))} | "
            f"{st['premium'].ok}/{st['premium'].sent} | {st['free'].ok}/{st['free'].sent} | "
            f"{s429} / {s503} / {unfinished} / {other} | "
            f"{_per_engine([_f(100 * h, '{:.0f}') for h in run.prefix_hit_rates()])} | "
            f"{'off' if run.affinity is None else ' / '.join(str(run.affinity[k]) for k in ('hit', 'spill', 'miss'))} |"
        )
        notes.append(f"{run.title}: premium response headers p50 / p99 {_f(run.premium_wait(.5))} / "
                     f"{_f(run.premium_wait(.99))} s (the wait in Sluice's queue), headers to first token "
                     f"{_f(run.premium_engine(.5))} / {_f(run.premium_engine(.99))} s (the engine)")
        notes += [f"{run.title}: {n}" for n in run.notes]
    return "\n".join(out + [""] + [f"- {n}" for n in notes]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a 15 s trace window (5 s replayed) and a 5 s capacity run (~1 min): a smoke test",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(PLACEMENTS)} (default: {', '.join(CONFIGS)})")
    ap.add_argument("--workdir", type=Path, default=None, help="where configs and process logs go (kept)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sluice-pool-"))
    t = time.monotonic()
    result = run(workdir, quick=args.quick, configs=args.configs,
                 log=lambda m: print(f"[pool {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True))
    print(markdown(result))
    print(f"[pool] took {time.monotonic() - t:.0f} s; logs in {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
