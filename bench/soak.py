"""Leak soak: 10,000 requests at high concurrency through Envoy + Sluice, most of them
streaming, with clients hanging up mid-stream (~10 %), backend errors (~5 %: a 500 before
any token, or the connection dropped after a few), a tenant over its budget (429s),
non-streaming requests (some whose clients hang up before the answer), embeddings, and
extproc restarted a few times under load (Envoy fails closed: 503 ``gateway_unavailable``,
then recovers). At the end nothing may be held: in flight 0, slots 0, KV reserved 0, the
token ledger balanced. A restart starts a fresh process with fresh books, so the checks
read the last extproc process, over the requests it saw; its RSS growth is from its
first sample after warm-up to the end.

And what was charged must be what the engine processed: every request the last extproc
settled is held against the simulated engine's own record of it (bench/billing.py),
within the bound of its charge's basis.

The backend runs 4x faster than real time (``--time-scale 4``): this part is about
bookkeeping under churn, not GPU timing, and the machine has two cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import billing
from bench.headline import sim_args
from bench.loadgen import CHAT_PATH, ClientPolicy, Result, new_session, prompt_text, send
from bench.procs import get_json, wait_idle
from bench.report import table, verdict
from bench.stack import Gateway, Ports, example_backend, example_gateway, proc_cpu_rss
from bench.trace import CHAT_MODEL, Request
from extproc.policy.schema import hash_key

KEYS = {"soak": "sk-bench-soak", "tiny": "sk-bench-tiny"}


def soak_policy(port: int) -> dict[str, Any]:
    return {
        "gateway": example_gateway(),
        "backends": [example_backend(port)],
        "tiers": {
            "soak": {"priority": 50, "tpm": 100_000_000, "rpm": 10_000_000, "max_concurrency": 1000,
                     "max_queue_wait_ms": 2000, "max_queue_depth": 256},
            # Two slots of its own, so it gets far enough to run out of tokens (429 tpm).
            "tiny": {"priority": 0, "tpm": 3000, "rpm": 10_000_000, "max_concurrency": 1000,
                     "guaranteed_slots": 2},
        },
        "tenants": [{"name": "soak-tenant", "tier": "soak", "keys": [hash_key(KEYS["soak"])]},
                    {"name": "tiny-tenant", "tier": "tiny", "keys": [hash_key(KEYS["tiny"])]}],
    }


@dataclass(frozen=True)
class Job:
    req: Request
    key: str
    # normal | cut_stream | cut_queued | backend_500 | fail_after | over_budget | json |
    # cut_json | embed
    kind: str
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None
    patience: ClientPolicy = ClientPolicy(30, 60)
    stream: bool = True
    path: str = CHAT_PATH
    body: bytes | None = None


def _embedding(req: Request, rng: random.Random) -> bytes:
    inputs = [prompt_text(rng.randint(8, 200)) for _ in range(rng.randint(1, 8))]
    return json.dumps({"model": req.model, "input": inputs}).encode()


def plan(n: int, seed: int = 17) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        gen = rng.randint(2, 12)
        req = Request(i, 0.0, "soak", "soak", CHAT_MODEL, rng.randint(16, 400), 64, gen)
        u = rng.random()
        if u < 0.08:  # hang up mid-stream
            jobs.append(Job(req, KEYS["soak"], "cut_stream", cut_after=rng.randint(1, gen - 1)))
        elif u < 0.10:  # give up before the first token (often while queued)
            jobs.append(Job(req, KEYS["soak"], "cut_queued", patience=ClientPolicy(rng.uniform(0.005, 0.3), 60)))
        elif u < 0.125:
            jobs.append(Job(req, KEYS["soak"], "backend_500", {"x-sim-status": "500"}))
        elif u < 0.15:
            jobs.append(Job(req, KEYS["soak"], "fail_after", {"x-sim-fail-after": str(rng.randint(1, gen - 1))}))
        elif u < 0.17:
            jobs.append(Job(req, KEYS["tiny"], "over_budget"))
        elif u < 0.20:
            jobs.append(Job(req, KEYS["soak"], "json", stream=False))
        elif u < 0.22:  # hang up before the (non-streaming) answer
            jobs.append(Job(req, KEYS["soak"], "cut_json", stream=False,
                            patience=ClientPolicy(rng.uniform(0.02, 0.3), 60)))
        elif u < 0.24:
            jobs.append(Job(req, KEYS["soak"], "embed", path="/v1/embeddings",
                            body=_embedding(req, rng)))
        else:
            jobs.append(Job(req, KEYS["soak"], "normal"))
    return jobs


@dataclass
class SoakResult:
    requests: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    final: dict[str, Any] = field(default_factory=dict)  # the last extproc's /debug/state
    engine: dict[str, Any] = field(default_factory=dict)
    rss_mb: list[tuple[int, float, float]] = field(default_factory=list)  # (process, start MB, end MB)
    seen_by_last: int = 0
    error: str | None = None
    # charged against processed, over the last extproc's settled requests: basis ->
    # (requests, charged, processed), and the requests outside their basis' bound
    billing: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    billing_problems: list[str] = field(default_factory=list)


def _outcome(r: Result) -> str:
    if r.gave_up:
        return f"client hung up ({r.gave_up})"
    if r.status == 200:
        return "200 complete" if r.done else "200 cut by backend"
    return f"{r.status} {r.reason}".strip() if r.status else f"no response ({r.error or 'reset'})"


def run(workdir: Path, *, quick: bool = False, log: Any = print) -> SoakResult:
    n, workers, restarts = (2000, 96, 2) if quick else (10_000, 128, 3)
    out = SoakResult(requests=n)
    jobs = plan(n)
    gw = Gateway(workdir / "soak", Ports())
    try:
        gw.start_sim("sim", gw.ports.sim, [*sim_args("preempt")[:-2], "--time-scale", "4"])
        policy_dir = gw.start_sluice(soak_policy(gw.ports.sim), "soak")
        admin = f"http://127.0.0.1:{gw.ports.admin}/debug/state"
        log(f"soak: {n} requests, {workers} concurrent clients, {restarts} extproc restarts")
        # Restarts early enough that the last process sees ~45 % of the requests.
        marks = [int(n * (0.15 + 0.2 * k)) for k in range(restarts)]
        rss: dict[int, list[float]] = {}
        state = {"sent": 0, "since_start": 0, "restarting": 0}
        tasks: list[asyncio.Task[None]] = []

        def sample_rss() -> None:
            pid = gw.procs["extproc"].pid
            rss.setdefault(pid, []).append(proc_cpu_rss(pid)[1] / 2**20)

        async def restart() -> None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, gw.procs["extproc"].stop)
            await loop.run_in_executor(None, lambda: gw.start_extproc(policy_dir, f"-{out.restarts + 1}"))
            out.restarts += 1
            state["since_start"], state["restarting"] = 0, 0

        async def drive() -> list[Result]:
            results: list[Result] = []
            t0 = time.monotonic()
            queue = iter(jobs)

            async def worker(session: Any) -> None:
                backoff = 0.25
                for job in queue:
                    state["sent"] += 1
                    state["since_start"] += 1
                    if marks and state["sent"] >= marks[0] and not state["restarting"]:
                        marks.pop(0)
                        state["restarting"] = 1
                        sample_rss()
                        tasks.append(asyncio.create_task(restart()))
                    if state["since_start"] == 1000:
                        sample_rss()  # after warm-up: the baseline for RSS growth
                    r = await send(session, gw.url, job.key, job.req, t0, job.patience, job.headers,
                                   cut_after_tokens=job.cut_after, stream=job.stream, body=job.body,
                                   path=job.path)
                    results.append(r)
                    if r.status == 503:  # fail-closed gateway: back off exponentially, as clients do
                        backoff = min(4.0, backoff * 2)
                        await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                    else:
                        backoff = 0.25

            async with new_session() as s:
                await asyncio.gather(*(worker(s) for _ in range(workers)))
            await asyncio.gather(*tasks)
            return results

        t = time.monotonic()
        results = asyncio.run(drive())
        out.seconds = time.monotonic() - t
        sample_rss()
        out.final = wait_idle(admin, 10)
        out.engine = get_json(f"http://127.0.0.1:{gw.ports.sim}/admin/engine")
        _check_billing(out, f"http://127.0.0.1:{gw.ports.admin}",
                       f"http://127.0.0.1:{gw.ports.sim}")
        out.rss_mb = [(pid, xs[0], xs[-1]) for pid, xs in rss.items()]
        out.seen_by_last = state["since_start"]
        out.outcomes = Counter(_outcome(r) for r in results)
        out.kinds = Counter(j.kind for j in jobs)
    except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
        out.error = f"{type(exc).__name__}: {exc}"
        log(f"soak failed: {out.error}\n{gw.logs()}")
    finally:
        gw.stop()
    return out


# The soak's bounds (bench/billing.py). A cut stream's estimate rests on a decode rate
# learned across every batch size the run goes through, so a request decoded faster than
# the mean is undercharged by the difference: the slack allows a quarter of a reservation.
BOUNDS = billing.Bounds(estimate_slack=16)


def _check_billing(out: SoakResult, admin: str, sim: str) -> None:
    """Pair the last extproc's settle records with the engine's work records. Requests the
    earlier processes settled have no record here, so only that direction is checked."""
    _, settled = billing.settled_since(admin)
    _, work = billing.work_since(sim)
    pairs = billing.pair(settled, work, billable_work=False)
    out.billing = billing.by_basis(pairs)
    out.billing_problems = billing.problems(pairs, BOUNDS)


def markdown(r: SoakResult) -> str:
    head = ["## Leak soak", ""]
    if r.error:
        return "\n".join(head + [f"Did not run: {r.error}", ""])
    st, led = r.final, r.final.get("ledger", {})
    be = st.get("backends", {}).get("sim", {})
    slots, kv = be.get("slots", {}).get("in_use"), be.get("kv", {}).get("reserved_tokens")
    queued = sum(be.get("queue", {}).get("depth", {}).values())
    last_pid, start_mb, end_mb = r.rss_mb[-1] if r.rss_mb else (0, 0.0, 0.0)
    growth = (end_mb - start_mb) / start_mb if start_mb else float("nan")
    mix = ", ".join(f"{k} {v}" for k, v in r.kinds.most_common())
    rows = [
        ["in flight (last extproc)", st.get("in_flight"), "0", verdict(st.get("in_flight") == 0)],
        ["slots in use", slots, "0", verdict(slots == 0)],
        ["KV reserved (tokens)", kv, "0", verdict(kv == 0)],
        ["admission queue depth", queued, "0", verdict(queued == 0)],
        [
            "token ledger: precharged + excess = charged + refunded, outstanding",
            f"{led.get('precharged', 0):,} + {led.get('excess', 0):,} = {led.get('charged', 0):,} + "
            f"{led.get('refunded', 0):,}; outstanding {led.get('outstanding')}",
            "balanced, 0",
            verdict(bool(led.get("balanced")) and led.get("outstanding") == 0),
        ],
        [
            "backend: running / waiting / KV blocks used at the end",
            f"{r.engine.get('running')} / {r.engine.get('waiting')} / {r.engine.get('kv_blocks_used')}",
            "0 / 0 / 0",
            verdict(
                r.engine.get("running") == 0 and r.engine.get("waiting") == 0 and r.engine.get("kv_blocks_used") == 0
            ),
        ],
        [
            f"extproc RSS (last process, {r.seen_by_last} requests)",
            f"{start_mb:.1f} -> {end_mb:.1f} MB ({growth:+.1%})",
            "< +10 %",
            verdict(growth < 0.10),
        ],
    ]
    rss_all = "; ".join(f"pid {p}: {a:.1f} -> {b:.1f} MB" for p, a, b in r.rss_mb)
    bill_rows = [[basis, n, f"{charged:,}", f"{done:,}", f"{charged / done:.3f}" if done else "–"]
                 for basis, (n, charged, done) in sorted(r.billing.items())]
    outside = r.billing_problems
    rows.append(["charged vs the engine's own record, per request, within each basis' bound",
                 f"{len(outside)} of {sum(n for n, _, _ in r.billing.values())} outside", "0",
                 verdict(not outside and bool(r.billing))])
    return "\n".join(head + [
        f"{r.requests:,} requests (most streaming) in {r.seconds:.0f} s, "
        f"{r.restarts} extproc restarts under load. "
        f"Planned mix: {mix}.",
        "",
        "Outcomes seen by clients: " + ", ".join(f"{k}: {v}" for k, v in r.outcomes.most_common()) + ".",
        "",
        table(["check", "measured", "expected", "verdict"], rows),
        "",
        f"RSS per extproc process (after its first ~1,000 requests -> at its end): {rss_all}.",
        "",
        "What the last extproc charged against what the simulated engine says it processed "
        "for the same requests (by x-request-id; bounds in bench/billing.py, estimate slack "
        f"{BOUNDS.estimate_slack}):",
        "",
        table(["basis", "requests", "charged", "engine processed", "charged / processed"],
              bill_rows),
        "",
        *(["Outside the bound (first 5):", "", *[f"- {m}" for m in outside[:5]], ""]
          if outside else []),
    ])
