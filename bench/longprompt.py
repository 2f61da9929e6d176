"""Seed 002's scenario: a burst of long prompts on top of steady chat.

Chat from the conversation trace (premium and free) at ``CHAT_LOAD`` x the capacity
measured in the same run, for ``before`` 8 s, ``long`` 15 s and ``after`` 12 s. At the
start of ``long``, ``LONG_COUNT`` documents of 16k-17k prompt tokens (seeded uniform;
summaries that run to their ``max_tokens`` of 1024) arrive within one second from the
batch tenant on the long-context model. Sluice (d)/(e)/(f) admits a document only while
its footprint (prompt + max_tokens; the learned length does not apply to a tenant it has
not seen) fits, and its ladder sheds the batch tier under pressure.

The backends schedule as vLLM V1 does (``SIM_EXTRA``: chunked prefill): a document is
admitted once its first 2,048-token chunk fits and takes blocks as it is prefilled, so
several get in at once and outgrow the 32k-token cache; each preemption throws away a
document's prefill (recompute). With whole-prompt scheduling (the simulator's default,
vLLM V0 without chunked prefill) FCFS admission stops at a document that does not fit, and
the unprotected backend showed head-of-line blocking and 0 preemptions instead.

Measured (2026-12-01, ``python -m bench.run --only longprompt``, 16k-24k documents):
(a) 98 preemptions, KV mean 85 %, 0 of 12 documents finished (they preempt each other until
their clients give up), chat ~104 completion tokens/s during ``long``, 1 of 24 premium
requests served; (d)/(e)/(f) 0 preemptions, chat ~260-270 tokens/s, 24 of 24 premium served
but after 6 s (p50, mostly Sluice's queue: the one admitted document's footprint leaves
room for only a few chat reservations), 1 document served and 10 refused 503. With
16k-17k documents: (a) 70 preemptions; (d)-(f) 0, premium TTFT p50 ~1.4-2.1 s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import headline
from bench.headline import CLIENTS, NAMES, Capacity, ConfigRun
from bench.loadgen import ClientPolicy
from bench.metrics import pct, tier_stats, tokens_between
from bench.trace import LONG_MODEL, Mix, Phase, Request, Schedule, build_schedule, load_trace

CHAT_LOAD = 0.6
# vLLM V1's scheduling (its default): prompts prefilled in 2,048-token chunks mixed with
# decode, blocks taken chunk by chunk, so several documents get in and then outgrow the cache.
SIM_EXTRA = ("--chunked-prefill", "--max-num-batched-tokens", "2048")
LONG_COUNT, LONG_RANGE, LONG_MAX_TOKENS = 12, (16_000, 24_000), 1024
# The run's tail: after the last chat arrival the run waits this long for documents still
# queued or running, one at a time on the 32k cache (~17 s each), so those queued while chat
# ran are served as the cache frees. Batch clients wait for a first token as long as Sluice
# lets a document wait in its queue (110 s, Envoy's limit) and send a revoked one again.
TAIL_S, TAIL_S_QUICK = 100.0, 40.0
LONG_CLIENTS = {**CLIENTS, "batch": ClientPolicy(115, 400)}


@dataclass
class LongPromptRun:
    capacity: Capacity
    schedule: Schedule
    runs: dict[str, ConfigRun] = field(default_factory=dict)
    quick: bool = False


def schedule(cap_rps: float, quick: bool, seed: int = 11) -> Schedule:
    phases = [Phase("before", 6 if quick else 8, CHAT_LOAD), Phase("long", 12 if quick else 15, CHAT_LOAD),
              Phase("after", 8 if quick else 12, CHAT_LOAD)]
    chat = build_schedule(load_trace(), phases, cap_rps, Mix(batch_share=0.0))
    rng = random.Random(seed)
    start = chat.bounds["long"][0]
    docs = [Request(0, start + rng.uniform(0, 1.0), "long", "batch", LONG_MODEL, rng.randint(*LONG_RANGE),
                    LONG_MAX_TOKENS, LONG_MAX_TOKENS) for _ in range(LONG_COUNT)]
    merged = sorted([*chat.requests, *docs], key=lambda r: r.at)
    reqs = [Request(i, r.at, r.phase, r.tier, r.model, r.prompt_tokens, r.max_tokens, r.gen_tokens)
            for i, r in enumerate(merged)]
    return Schedule(reqs, phases, cap_rps, chat.bounds)


def run(workdir: Path, *, quick: bool = False, configs: str = "adefgh", log: Any = print) -> LongPromptRun:
    cap = headline.measure_capacity(workdir / "long-capacity", Mix(batch_share=0.0), "preempt",
                                    12.0 if quick else 20.0, 4.0 if quick else 5.0, log, SIM_EXTRA)
    log(f"longprompt: capacity {cap.tok_s:.0f} tokens/s, {cap.rps:.2f} req/s (chat only)")
    sched = schedule(cap.rps, quick)
    out = LongPromptRun(cap, sched, quick=quick)
    for key in configs:
        r, _ = headline.run_config(
            key,
            workdir / "longprompt",
            sched,
            cap,
            "preempt",
            TAIL_S_QUICK if quick else TAIL_S,
            log,
            sim_extra=SIM_EXTRA,
            clients=LONG_CLIENTS,
        )
        r.name = NAMES[key]
        out.runs[key] = r
    return out


def revocation_cost(run: ConfigRun) -> str:
    """Revocations and the work they threw away (Sluice's count), and the decision-to-engine-free
    latency: the engine's abort log joined to Sluice's revocations by x-request-id."""
    st = ((run.sluice_end or {}).get("backends") or {}).get("sim", {}).get("kv_shares")
    if not st:
        return "–"
    rev = st["revocation"]
    n = sum(rev["revoked"].values())
    wasted = sum(rev["wasted_tokens"].values())
    freed = {a["request_id"]: a["at"] for a in run.aborts if a.get("request_id")}
    lat = sorted(
        (freed[r["request_id"]] - r["at"]) * 1000 for r in rev["recent"] if r["request_id"] in freed
    )
    tail = f"; to engine free p50 {pct(lat, 0.5):.0f} / max {lat[-1]:.0f} ms" if lat else ""
    return f"{n} ({wasted:,} tokens thrown away{tail})"


def doc_goodput(run: ConfigRun, s: LongPromptRun) -> str:
    """Completion tokens of the documents served, per second from their arrival to the last one's
    end (or the run's), and that as a share of the capacity measured in the run."""
    a = s.schedule.bounds["long"][0]
    docs = [r for r in run.results if r.tier == "batch" and r.ok]
    if not docs:
        return "0"
    tokens = sum(r.usage_completion or r.tokens for r in docs)
    span = max(r.end or a for r in docs) - a
    rate = tokens / span if span > 0 else 0.0
    return f"{rate:.0f} ({rate / s.capacity.tok_s:.0%})"


def rows(s: LongPromptRun) -> list[list[object]]:
    from bench.report import counter_delta, frac, ms

    a, b = s.schedule.bounds["long"]
    end = s.schedule.seconds
    out: list[list[object]] = []
    for run in s.runs.values():
        if run.error:
            out.append([run.name, f"did not run: {run.error}"] + [""] * 10)
            continue
        pre = counter_delta(run.samples, a, end + 10.0, "preemptions")
        kv = [x.kv_usage for x in run.samples if x.kv_usage is not None and a <= x.t < end]
        prem = tier_stats([r for r in run.results if r.tier == "premium" and r.phase == "long"])
        chat = [r for r in run.results if r.tier != "batch"]
        docs = tier_stats([r for r in run.results if r.tier == "batch"])
        out.append([run.name, pre, frac(max(kv, default=float("nan"))),
                    frac(sum(kv) / len(kv) if kv else float("nan")),
                    f"{prem.ok} / {prem.sent}: {ms(prem.ttft_p50)} / {ms(prem.ttft_p99)}",
                    f"{tokens_between(chat, a, b) / (b - a):.0f}",
                    f"{docs.ok} / {docs.sent}", docs.rejected_429 + docs.rejected_503, docs.gave_up + docs.unfinished,
                    f"{ms(docs.ttft_p50)} / {ms(docs.ttft_p99)}", doc_goodput(run, s), revocation_cost(run)])
    return out


def markdown(s: LongPromptRun) -> str:
    from bench.report import table

    p = ", ".join(f"{ph.name} {ph.seconds:.0f} s" for ph in s.schedule.phases)
    lines = [
        f"## Long prompts: a burst of {LONG_RANGE[0] // 1000}k-{LONG_RANGE[1] // 1000}k-token documents "
        "on top of steady chat",
        "",
        f"Chat (premium and free) at {CHAT_LOAD:g}x the capacity measured in this run ({s.capacity.rps:.2f} "
        f"req/s); phases {p}; at the start of `long`, {LONG_COUNT} documents of {LONG_RANGE[0]:,}-"
        f"{LONG_RANGE[1]:,} prompt tokens (batch tenant, long-context model, max_tokens {LONG_MAX_TOKENS}) "
        "within one second. Preemptions from the start of `long` to 10 s after the last arrival; KV over the "
        "same span; chat goodput in completion tokens/s during `long`; TTFT p50 / p99 in ms (of the requests "
        "that finished). The backends prefill in 2,048-token chunks as vLLM V1 does (`--chunked-prefill`). "
        f"After the last chat arrival the run waits up to {TAIL_S_QUICK if s.quick else TAIL_S:.0f} s for the "
        "documents; batch clients wait up to 115 s for a first token and send a revoked document again after "
        "its Retry-After. Document goodput: completion tokens/s of the documents served, from their arrival to "
        "the last one's end, and its share of the capacity. Revocations: requests revoked, the work they threw "
        "away (prompt prefilled + tokens generated) and the time from the decision to the engine freeing the "
        "blocks (the engine's abort log).",
        "",
        table(
            [
                "configuration",
                "preemptions",
                "KV peak",
                "KV mean",
                "premium in long: ok / sent: TTFT",
                "chat tokens/s in long",
                "documents ok / sent",
                "documents refused",
                "documents gave up / open",
                "document TTFT",
                "document goodput tokens/s",
                "revocations",
            ],
            rows(s),
        ),
    ]
    for run in s.runs.values():
        for note in run.notes:
            lines += ["", f"{run.name}: {note}"]
    return "\n".join(lines) + "\n"
