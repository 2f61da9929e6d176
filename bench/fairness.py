"""Fair share by work: two tenants of one tier, a heavy one at overload and a light one.

The light tenant sends short chats (200-token prompts, 100 tokens out) at a steady rate
well under the backend's capacity; the heavy tenant keeps ``HEAVY_CLIENTS`` clients each
sending long prompts (3,000 tokens, 200 out) back to back, far more than the backend
can serve, so Sluice's queue is always full of its requests. Both are in the same tier
("free"), so tier weights cannot help: only fair share by work within the tier (virtual
token counters, extproc.policy.fair_share) decides whose request goes next.

Measured, in one run against fresh backends with the same settings as the headline's:

    light alone                  the light tenant alone through Envoy + Sluice (the baseline)
    heavy, no limiter            both, Envoy straight to the backend: the engine's FCFS queue
    heavy, Sluice                both, through Envoy + Sluice: fair share by work
    heavy, Sluice + watermark    as above, with the KV watermark feedback on (the example
                                 policy's: 85 % / 70 %, floor 0.6, recovering 0.05/s)

Without the watermark the backend has no ``metrics_url``: Sluice's worst-case reservations
alone bound the cache (they never exceed it), so the capacity is constant and the rows
differ only in who goes first. With it, the heavy tenant's requests fill the cache to
~95 % as they near their end, the watermark cuts the KV budget to 60 % and it takes
seconds to come back: every tenant waits for that, the light one too (it is first in line
when room comes back).

Reported: the light tenant's TTFT p50 / p99 and its p99 as a multiple of alone (the
target: within 1.5x), both tenants' completion tokens/s, and the tier's service difference and Jain's index from
/debug/state at the end of the measured window. Timing is real (time scale 1): on a
shared machine, compare the rows of one run, not runs.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.headline import sim_args
from bench.loadgen import ClientPolicy, Result, new_session, send
from bench.metrics import pct
from bench.procs import get_json
from bench.report import table
from bench.stack import (
    BackendRoute,
    Gateway,
    Ports,
    envoy_config,
    envoy_options,
    example_backend,
    example_gateway,
)
from bench.trace import CHAT_MODEL, Request
from extproc.policy.schema import hash_key

KEYS = {"light": "sk-bench-light", "heavy": "sk-bench-heavy"}
LIGHT_RPS, LIGHT_PROMPT, LIGHT_OUT = 2.0, 200, 100
HEAVY_CLIENTS, HEAVY_PROMPT, HEAVY_OUT = 48, 3000, 200
TARGET = 1.5
PATIENCE = ClientPolicy(30, 120)


def fairness_policy(port: int, watermark: bool) -> dict[str, Any]:
    tier: dict[str, Any] = {
        "priority": 10,
        "tpm": 10**9,
        "rpm": 10**7,
        "max_concurrency": 256,
        "max_queue_wait_ms": 25_000,
        "max_queue_depth": 512,
    }
    backend = example_backend(port)
    backend["kv_reservation"] = "worst_case"
    if not watermark:
        backend.pop("metrics_url", None)
    return {
        "gateway": example_gateway(),
        "backends": [backend],
        "tiers": {"free": tier},
        "tenants": [
            {"name": name, "tier": "free", "keys": [hash_key(key)]} for name, key in KEYS.items()
        ],
    }


@dataclass
class Row:
    name: str
    light: list[Result] = field(default_factory=list)
    heavy: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    fair: dict[str, Any] | None = None  # the tier's fair_share status from /debug/state
    error: str | None = None


@dataclass
class FairnessRun:
    rows: list[Row]
    warm_s: float
    measure_s: float


def _light(i: int, at: float) -> Request:
    return Request(i, at, "measure", "light", CHAT_MODEL, LIGHT_PROMPT, LIGHT_OUT, LIGHT_OUT)


def _heavy(i: int) -> Request:
    return Request(
        100_000 + i, 0.0, "measure", "heavy", CHAT_MODEL, HEAVY_PROMPT, HEAVY_OUT, HEAVY_OUT
    )


async def _drive(
    url: str, heavy: bool, warm_s: float, measure_s: float
) -> tuple[list[Result], list[Result]]:
    """Light arrivals (Poisson) for warm + measure; heavy clients back to back. Returns the
    results of requests sent in the measured window (after the warm-up)."""
    rng = random.Random(13)
    t0 = time.monotonic()
    stop = t0 + warm_s + measure_s
    light: list[Result] = []
    heavy_out: list[Result] = []

    async def light_loop(session: Any) -> None:
        tasks = []
        at, i = 0.0, 0
        while at < warm_s + measure_s:
            at += rng.expovariate(LIGHT_RPS)
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(send(session, url, KEYS["light"], _light(i, at), t0, PATIENCE))
            )
            i += 1
        light.extend(await asyncio.gather(*tasks))

    async def heavy_client(session: Any, k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            res = await send(session, url, KEYS["heavy"], _heavy(k * 10_000 + n), t0, PATIENCE)
            n += 1
            heavy_out.append(res)
            if res.status != 200:
                await asyncio.sleep(0.2)

    async with new_session() as session:
        jobs = [asyncio.create_task(light_loop(session))]
        if heavy:
            jobs += [asyncio.create_task(heavy_client(session, k)) for k in range(HEAVY_CLIENTS)]
        await asyncio.gather(*jobs)
    keep = [r for r in light if r.sent >= warm_s]
    return keep, [r for r in heavy_out if r.sent >= warm_s]


def _one(
    workdir: Path,
    name: str,
    sluice: bool,
    heavy: bool,
    watermark: bool,
    warm_s: float,
    measure_s: float,
    log: Any,
) -> Row:
    row = Row(name, seconds=measure_s)
    gw = Gateway(workdir / name.replace(" ", "-").replace(",", ""), Ports())
    try:
        gw.start_sim("sim", gw.ports.sim, sim_args("preempt"))
        doc = fairness_policy(gw.ports.sim, watermark)
        if sluice:
            gw.start_sluice(doc, "fair")
        else:
            gw.start_envoy(
                envoy_config(
                    "none",
                    [BackendRoute("sim", "127.0.0.1", gw.ports.sim)],
                    envoy_options(gw.ports, doc),
                ),
                "fair",
            )
        log(f"fairness: {name} ({warm_s:.0f} s warm-up, {measure_s:.0f} s measured)")
        row.light, row.heavy = asyncio.run(_drive(gw.url, heavy, warm_s, measure_s))
        if sluice:
            st = get_json(f"http://127.0.0.1:{gw.ports.admin}/debug/state")
            row.fair = st["backends"]["sim"].get("fair_share", {}).get("free")
    except Exception as exc:  # noqa: BLE001 - reported, the other rows still run
        row.error = f"{type(exc).__name__}: {exc}"
        log(f"fairness {name} failed: {row.error}\n{gw.logs()}")
    finally:
        gw.stop()
    return row


def run(workdir: Path, *, quick: bool = False, log: Any = print) -> FairnessRun:
    warm, measure = (5.0, 15.0) if quick else (10.0, 40.0)
    rows = [
        _one(workdir, "light alone", True, False, False, warm, measure, log),
        _one(workdir, "heavy, no limiter", False, True, False, warm, measure, log),
        _one(workdir, "heavy, Sluice", True, True, False, warm, measure, log),
        _one(workdir, "heavy, Sluice + watermark", True, True, True, warm, measure, log),
    ]
    return FairnessRun(rows, warm, measure)


def _ms(x: float) -> str:
    return "–" if x != x else f"{x * 1000:.0f}"


def markdown(f: FairnessRun) -> str:
    base = next((r for r in f.rows if r.name == "light alone" and not r.error), None)
    alone = (
        pct([r.ttft for r in base.light if r.ok and r.ttft is not None], 0.99)
        if base
        else float("nan")
    )
    out = []
    for r in f.rows:
        if r.error:
            out.append([r.name, f"did not run: {r.error}", "", "", "", "", ""])
            continue
        ok = [x for x in r.light if x.ok and x.ttft is not None]
        p50, p90, p99 = (pct([x.ttft for x in ok], q) for q in (0.5, 0.9, 0.99))
        ratio = p99 / alone if alone == alone and alone > 0 else float("nan")
        light_tok = sum(x.tokens for x in r.light if x.ok) / r.seconds
        heavy_tok = sum(x.tokens for x in r.heavy if x.ok) / r.seconds
        fair = "–" if not r.fair else f"{r.fair['service_difference']:,.0f} / {r.fair['jain']:.3f}"
        out.append(
            [
                r.name,
                f"{len(ok)} / {len(r.light)}",
                f"{_ms(p50)} / {_ms(p90)} / {_ms(p99)}",
                "–"
                if ratio != ratio
                else f"{ratio:.2f}x" + (" (target <= 1.5x)" if r.name != "light alone" else ""),
                f"{light_tok:.0f} / {heavy_tok:.0f}",
                fair,
                str(sum(1 for x in r.heavy if x.status in (429, 503))),
            ]
        )
    lines = [
        "## Fair share by work: a heavy and a light tenant in one tier",
        "",
        f"Both tenants in tier `free`. Light: {LIGHT_PROMPT}-token prompts, {LIGHT_OUT} tokens out, Poisson at "
        f"{LIGHT_RPS:g} req/s. Heavy: {HEAVY_CLIENTS} clients back to back, {HEAVY_PROMPT}-token prompts, "
        f"{HEAVY_OUT} out (far past the backend's capacity). {f.warm_s:.0f} s warm-up, then {f.measure_s:.0f} s "
        "measured (requests sent in it). Service difference and Jain's index: the tier's fair-share counters "
        "among the tenants waiting at the end (work = input + 2 x output tokens). TTFT in ms. One run, rows "
        "compared with each other (real time on a shared machine).",
        "",
        table(
            [
                "configuration",
                "light ok / sent",
                "light TTFT p50 / p90 / p99",
                "light p99 / alone",
                "completion tokens/s light / heavy",
                "service difference / Jain",
                "heavy refused",
            ],
            out,
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sluice-fairness-") as d:
        print(markdown(run(Path(d))))


if __name__ == "__main__":
    main()
