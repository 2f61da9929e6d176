"""The headline benchmark: one trace-driven schedule against four gateways, one at a time.

    (a) Envoy straight to the backend, no limiter
    (b) Envoy's local_ratelimit at the backend's nominal request rate
    (c) the LiteLLM proxy with the example policy's per-key TPM / RPM / parallel limits
    (d) Envoy + Sluice with the example policy (only the backends' addresses rewritten)
    (e) as (d), with ``kv_reservation: learned`` on the main backend
    (f) as (e), plus latency SLOs (premium ``ttft_p99_ms``) driving the adaptive
        concurrency limit
    (g) as (f), plus KV guarantees (premium keeps half of the cache while it has demand),
        revocation (premium may take room back; batch is revocable in the example policy)
        and engine priority (the backend schedules by priority, Sluice writes each tier's);
        the batch tier queues documents instead of shedding them, for up to 110 s
    (h) as (g) with premium keeping a quarter of the cache, not half (the long-prompt
        benchmark only: documents start during chat, and revocation takes room back)

Each configuration gets a fresh simulated backend with the same settings (the example
policy's: 2048 KV blocks of 16 tokens = 32k tokens, 64 sequences, a 32k context for the
long model), in real time (``--time-scale 1``) because Sluice's budgets, queue waits and
watermark recovery run on the wall clock. The backend's capacity is measured first, in
the same run: a closed loop of the same request mix straight to a fresh backend at 1.5x
the concurrency whose mean KV footprint fills the cache, so the backend's own queue keeps
the cache full (saturation) while nothing needs preempting.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import litellm_proxy
from bench.loadgen import ClientPolicy, OpenLoop, Result, closed_loop, send
from bench.metrics import tokens_between
from bench.procs import get_json, wait_idle
from bench.sampler import Sample, Sampler
from bench.stack import (
    Gateway,
    Ports,
    envoy_config,
    envoy_options,
    example_policy,
    load_policy_doc,
    proc_cpu_rss,
)
from bench.trace import (
    Mix,
    Request,
    Schedule,
    build_schedule,
    default_phases,
    load_trace,
    mean_kv_tokens,
    sample_mix,
)
from extproc.envoy.bootstrap import BackendRoute

NAMES = {
    "a": "(a) Envoy, no limiter",
    "b": "(b) Envoy local_ratelimit",
    "c": "(c) LiteLLM proxy",
    "d": "(d) Envoy + Sluice",
    "e": "(e) Sluice, learned KV",
    "f": "(f) Sluice, learned KV + SLO",
    "g": "(g) (f) + KV guarantees, revocation, engine priority",
    "h": "(h) as (g), premium guaranteed a quarter",
}
SLUICE = "defgh"  # the configurations that run Sluice
# (g)'s KV shares: premium keeps half of each cache while it has demand (room for its chat at
# the trace's load: ~9 requests of ~1.6k-token learned footprints in flight); the batch tier
# waits for the cache (queued, not shed) as long as Envoy lets a request wait.
G_TIERS: dict[str, dict[str, Any]] = {
    "premium": {"kv_guaranteed": 0.5},
    "batch": {"degrade": {}, "max_queue_wait_ms": 110_000, "revocable": True},
}
H_PREMIUM_SHARE = 0.25  # (h): premium's guarantee, for documents to start during chat
PRIORITY_SIM = ("--scheduling-policy", "priority")  # (g)'s and (h)'s backend: vLLM's priority scheduling
# (f)'s latency SLOs for premium. Time to first token after admission: premium p99 TTFT
# is ~1 s on an unloaded backend in this mix (a 16k-token batch prefill stalls decoding
# for ~0.4 s), so the target leaves room for that and no more. Inter-token latency: a
# full batch decodes at ~25 ms per token; 40 ms is a stream users still read as fluent.
SLOS = {"premium": {"ttft_p99_ms": 1500, "itl_p99_ms": 40}}
SLO_TTFT_MS = {tier: s["ttft_p99_ms"] for tier, s in SLOS.items()}
# The demo keys from the README; policies/tenants.yaml holds their sha256.
KEYS = {"premium": "sk-demo-premium", "free": "sk-demo-free", "batch": "sk-demo-batch"}
TENANTS = {"premium": "acme", "free": "hobbyist", "batch": "nightly-etl"}
# How long clients wait: interactive chat users give up after 15 s without a token.
CLIENTS = {"premium": ClientPolicy(15, 120), "free": ClientPolicy(15, 120), "batch": ClientPolicy(60, 300)}
KV_BLOCKS, BLOCK, SEQS = 2048, 16, 64
MODELS = ["sim-llama-8b", "sim-llama-8b-long"]
FALLBACK_MODEL = "sim-llama-1b"


def sim_args(mode: str) -> list[str]:
    return ["--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--max-num-seqs", str(SEQS),
            "--max-model-len", "32768", "--mode", mode, "--time-scale", "1"]


@dataclass
class Capacity:
    tok_s: float  # completion tokens/s at saturation
    rps: float
    concurrency: int
    seconds: float
    preemptions: int
    kv_peak: float


@dataclass
class ConfigRun:
    key: str
    name: str
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)  # the backend's counters at the end
    cpu: dict[str, float] = field(default_factory=dict)  # process -> mean cores over the run
    rss_mb: dict[str, float] = field(default_factory=dict)
    sluice_end: dict[str, Any] | None = None
    aborts: list[dict[str, Any]] = field(default_factory=list)  # the backend's abort log (x-request-id, when freed)
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Headline:
    capacity: Capacity
    schedule: Schedule
    runs: dict[str, ConfigRun]
    litellm_latency: dict[str, float] | None = None
    mode: str = "preempt"


def measure_capacity(workdir: Path, mix: Mix, mode: str, seconds: float, warm: float, log: Any,
                     sim_extra: tuple[str, ...] = ()) -> Capacity:
    rows = load_trace()
    reqs = sample_mix(rows, 20000, mix, seed=3)
    fit = KV_BLOCKS * BLOCK / mean_kv_tokens(reqs)
    workers = math.ceil(1.5 * fit)
    log(f"capacity: closed loop, {workers} clients ({fit:.1f} fill the KV cache on average), {seconds:.0f} s")
    with Gateway(workdir / "capacity", Ports()) as gw:
        gw.start_sim("sim", gw.ports.sim, [*sim_args(mode), *sim_extra])
        url = f"http://127.0.0.1:{gw.ports.sim}"
        t0 = time.monotonic()
        res = asyncio.run(closed_loop(url, KEYS, iter(reqs), workers, seconds, t0))
        eng = get_json(url + "/admin/engine")
    window = seconds - warm
    tok = tokens_between(res, warm, seconds)
    done = sum(1 for r in res if r.ok and r.end is not None and warm <= r.end < seconds)
    return Capacity(tok / window, done / window, workers, window, eng["preemptions_total"],
                    eng["kv_blocks_peak"] / eng["kv_blocks_total"])


def _warm_up(url: str, keys: dict[str, str]) -> None:
    """One tiny request per tier so first-request costs (imports, connections) are paid."""
    async def go() -> None:
        from bench.loadgen import new_session
        async with new_session() as s:
            for tier in ("premium", "free", "batch"):
                req = Request(-1, 0.0, "warmup", tier, MODELS[0], 16, 4, 2)
                await send(s, url, keys[tier], req, time.monotonic(), ClientPolicy(30, 30))
    asyncio.run(go())


def litellm_latency(gw: Gateway, n: int = 150) -> dict[str, float]:
    """Sequential small non-streaming requests: straight to the backend, then through LiteLLM."""
    from bench.loadgen import new_session
    from bench.metrics import pct

    async def series(url: str) -> list[float]:
        out = []
        async with new_session() as s:
            for i in range(n):
                req = Request(i, 0.0, "latency", "premium", MODELS[0], 24, 1, 1)
                t = time.monotonic()
                r = await send(s, url, KEYS["premium"], req, t, ClientPolicy(10, 10), stream=False)
                if r.status == 200:
                    out.append(time.monotonic() - t)
        return out

    direct = asyncio.run(series(f"http://127.0.0.1:{gw.ports.sim}"))
    proxied = asyncio.run(series(gw.url))
    return {"direct_p50": pct(direct, .5), "direct_p99": pct(direct, .99),
            "litellm_p50": pct(proxied, .5), "litellm_p99": pct(proxied, .99), "n": float(len(proxied))}


def standalone_litellm_latency(workdir: Path, log: Any = print) -> dict[str, float] | None:
    """LiteLLM's added latency without the headline run: a backend and the proxy, nothing else."""
    why = litellm_proxy.ensure_installed(log=log)
    if why:
        log(f"LiteLLM unavailable: {why}")
        return None
    with Gateway(workdir / "litellm-latency", Ports()) as gw:
        gw.start_sim("sim", gw.ports.sim, sim_args("preempt"))
        doc = load_policy_doc(example_policy(gw.workdir / "policies", {"sim": gw.ports.sim, "sim-small": 1}))
        limits = litellm_proxy.tier_limits(doc)
        litellm_proxy.start_proxy(gw, gw.ports.sim, MODELS,
                                  {KEYS[t]: {"tenant": TENANTS[t], **limits[t]} for t in KEYS})
        _warm_up(gw.url, KEYS)
        return litellm_latency(gw)


def _start(key: str, gw: Gateway, cap: Capacity, mode: str, run: ConfigRun,
           sim_extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Start configuration ``key``'s processes; returns the pids whose CPU to follow."""
    ports = gw.ports
    gw.start_sim("sim", ports.sim, [*sim_args(mode), *sim_extra, *(PRIORITY_SIM if key in "gh" else ())])
    pids = {"backend": gw.procs["sim"].pid}
    policy_dir = example_policy(gw.workdir / "policies", {"sim": ports.sim, "sim-small": ports.small})
    doc = load_policy_doc(policy_dir)
    opts = envoy_options(ports, doc)
    sim_route = BackendRoute("sim", "127.0.0.1", ports.sim)
    if key in SLUICE:
        variant_policy(policy_dir, key)
        gw.start_sim("small", ports.small, [*sim_args(mode), *sim_extra, "--model", FALLBACK_MODEL])
        gw.start_extproc(policy_dir)
        cfg = envoy_config("sluice", [sim_route, BackendRoute("sim-small", "127.0.0.1", ports.small)], opts)
        pids["extproc"] = gw.procs["extproc"].pid
    elif key == "c":
        why = litellm_proxy.ensure_installed(log=print)
        if why:
            raise RuntimeError(why)
        limits = litellm_proxy.tier_limits(doc)
        keys = {KEYS[t]: {"tenant": TENANTS[t], **limits[t]} for t in KEYS}
        litellm_proxy.start_proxy(gw, ports.sim, MODELS, keys)
        pids["litellm"] = gw.procs["proxy"].pid
        return pids
    else:
        cfg = envoy_config("ratelimit" if key == "b" else "none", [sim_route], opts, rps=cap.rps)
        if key == "b":
            run.notes.append(
                f"local_ratelimit: {cap.rps:.2f} req/s (the measured capacity), burst {math.ceil(cap.rps)}"
            )
    gw.start_envoy(cfg, key)
    pids["envoy"] = gw.procs["envoy"].pid
    return pids


def variant_policy(policy_dir: Path, key: str) -> None:
    """(e)-(h): the example policy with learned reservations (SLOs, KV shares) on top."""
    if key not in "efgh":
        return
    import yaml

    for f in sorted(policy_dir.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        if not isinstance(doc, dict):
            continue
        for b in doc.get("backends") or []:
            if b["name"] == "sim":
                b["kv_reservation"] = "learned"
                if key in "gh":
                    b["engine_priority"] = "vllm"
        tiers = doc.get("tiers") or {}
        if key in "fgh":
            for tier, slo in SLOS.items():
                if tier in tiers:
                    tiers[tier].update(slo)
        if key in "gh":
            for tier, extra in G_TIERS.items():
                if tier in tiers:
                    tiers[tier].update(extra)
            if key == "h" and "premium" in tiers:
                tiers["premium"]["kv_guaranteed"] = H_PREMIUM_SHARE
        f.write_text(yaml.safe_dump(doc, sort_keys=False))


def learning_notes(run: ConfigRun) -> list[str]:
    """What (e)/(f) learned: the completion lengths reserved, and the latency limit's path."""
    end = run.sluice_end or {}
    notes = []
    learned = [e for e in (end.get("completions") or {}).get("estimates", []) if e["kind"] == "tenant"]
    if learned and run.key in "efgh":
        notes.append("learned completion lengths at the end (p95, tokens): " + ", ".join(
            f"{e['name']}/{e['model']} {e['tokens']} ({e['samples']} samples)" for e in learned))
    adaptive = (end.get("backends") or {}).get("sim", {}).get("adaptive")
    limits = [s.limit for s in run.samples if s.limit is not None]
    if adaptive and limits:
        notes.append(f"latency limit (ceiling {adaptive['ceiling']}): lowest {min(limits)} during the run, "
                     f"{adaptive['cuts']} cuts in {adaptive['windows']} windows, {adaptive['limit']} at the end")
    return notes


def sim_admin(port: int, cfg: dict[str, Any]) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/config", data=json.dumps(cfg).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def run_config(key: str, workdir: Path, sched: Schedule, cap: Capacity, mode: str, drain_s: float,
               log: Any, events: list[tuple[float, dict[str, Any]]] | None = None,
               sim_extra: tuple[str, ...] = (), clients: dict[str, ClientPolicy] | None = None
               ) -> tuple[ConfigRun, dict[str, float] | None]:
    """``events``: (seconds after the start, /admin/config body) sent to the backend mid-run;
    ``sim_extra``: more simulated-backend flags (``--chunked-prefill``); ``clients``: each
    tier's patience (default ``CLIENTS``). Batch clients send a revoked request again."""
    run = ConfigRun(key, NAMES[key])
    latency = None
    gw = Gateway(workdir / key, Ports())
    try:
        pids = _start(key, gw, cap, mode, run, sim_extra)
        _warm_up(gw.url, KEYS)
        if key == "c":
            latency = litellm_latency(gw)
        admin = f"http://127.0.0.1:{gw.ports.admin}/debug/state" if key in SLUICE else None
        sampler = Sampler(f"http://127.0.0.1:{gw.ports.sim}/admin/engine", admin, pids=pids)
        loop = OpenLoop(gw.url, KEYS, clients or CLIENTS, drain_s=drain_s, retry_revoked=frozenset({"batch"}))

        async def at(t0: float, offset: float, cfg: dict[str, Any]) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            await asyncio.to_thread(sim_admin, gw.ports.sim, cfg)

        async def drive() -> list[Result]:
            stop = asyncio.Event()
            t0 = time.monotonic() + 0.3
            task = asyncio.create_task(sampler.run(t0, stop))
            timers = [asyncio.create_task(at(t0, off, cfg)) for off, cfg in events or []]
            try:
                return await loop.run(sched.requests, t0)
            finally:
                stop.set()
                await task
                for t in timers:
                    t.cancel()

        before = {n: proc_cpu_rss(p)[0] for n, p in pids.items()}
        t_start = time.monotonic()
        log(f"{NAMES[key]}: {len(sched.requests)} requests over {sched.seconds:.0f} s")
        run.results = asyncio.run(drive())
        elapsed = time.monotonic() - t_start
        for n, p in pids.items():
            cpu, rss = proc_cpu_rss(p)
            run.cpu[n] = (cpu - before[n]) / elapsed
            run.rss_mb[n] = rss / 2**20
        run.samples = sampler.samples
        run.engine = get_json(f"http://127.0.0.1:{gw.ports.sim}/admin/engine")
        run.aborts = get_json(f"http://127.0.0.1:{gw.ports.sim}/admin/aborts")
        if key in SLUICE:
            run.sluice_end = wait_idle(admin or "", 5)  # clients cut at the end settle within moments
            led = run.sluice_end["ledger"]
            run.notes.append(f"Sluice after the run: in flight {run.sluice_end['in_flight']}, "
                             f"ledger balanced {led['balanced']} (outstanding {led['outstanding']}).")
            run.notes += learning_notes(run)
    except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is reported, not fatal
        run.error = f"{type(exc).__name__}: {exc}"
        log(f"{NAMES[key]} failed: {run.error}\n{gw.logs()}")
    finally:
        gw.stop()
    return run, latency


def run(workdir: Path, *, quick: bool = False, configs: str = "abcdefg", mode: str = "preempt",
        log: Any = print) -> Headline:
    mix = Mix()
    cap = measure_capacity(workdir, mix, mode, 12.0 if quick else 20.0, 4.0 if quick else 5.0, log)
    log(f"capacity: {cap.tok_s:.0f} completion tokens/s, {cap.rps:.2f} req/s, "
        f"{cap.preemptions} preemptions, KV peak {cap.kv_peak:.0%}")
    sched = build_schedule(load_trace(), default_phases(quick), cap.rps, mix)
    runs: dict[str, ConfigRun] = {}
    latency = None
    for key in configs:
        r, lat = run_config(key, workdir, sched, cap, mode, 6.0, log)
        runs[key] = r
        latency = latency or lat
    return Headline(cap, sched, runs, latency, mode)


def phase_of(sched: Schedule, t: float) -> str | None:
    return next((name for name, (a, b) in sched.bounds.items() if a <= t < b), None)
