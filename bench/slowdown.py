"""The slowdown scenario: the backend decodes at half speed for 20 s, its KV cache unchanged.

Chat only (premium and free, the headline's mix without the batch tenant) at ``LOAD`` x
the capacity measured in the same run, three phases: ``before`` 10 s, ``slow`` 20 s (the
simulated engine's decode steps take twice as long: POST /admin/config
``{"slowdown": {"factor": 2, "seconds": 20}}``), ``after`` 15 s. The same schedule runs
against

    (e) Sluice with learned KV reservations, no latency SLO: only the KV watermark reacts
    (f) the same plus premium's ``ttft_p99_ms`` / ``itl_p99_ms`` (``headline.SLOS``)
        driving the adaptive concurrency limit

What it should show: with (f), premium's TTFT p99 stays under its SLO through the slow
phase while free is degraded or refused first; with (e) the KV picture never changes, so
nothing reacts and both tiers slow down together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import headline
from bench.headline import NAMES, SLOS, Capacity, ConfigRun
from bench.metrics import pct, tier_stats
from bench.trace import Mix, Phase, Schedule, build_schedule, load_trace

LOAD = 0.8
FACTOR, SLOW_AT, SLOW_S = 2.0, 10.0, 20.0
TIERS = ("premium", "free")


@dataclass
class SlowdownRun:
    capacity: Capacity
    schedule: Schedule
    runs: dict[str, ConfigRun] = field(default_factory=dict)


def phases(quick: bool) -> list[Phase]:
    if quick:
        return [Phase("before", 6, LOAD), Phase("slow", SLOW_S, LOAD), Phase("after", 8, LOAD)]
    return [Phase("before", SLOW_AT, LOAD), Phase("slow", SLOW_S, LOAD), Phase("after", 15, LOAD)]


def run(workdir: Path, *, quick: bool = False, configs: str = "ef", log: Any = print) -> SlowdownRun:
    mix = Mix(batch_share=0.0)
    cap = headline.measure_capacity(workdir / "slowdown-capacity", mix, "preempt", 12.0 if quick else 20.0,
                                    4.0 if quick else 5.0, log)
    log(f"slowdown: capacity {cap.tok_s:.0f} tokens/s, {cap.rps:.2f} req/s (chat only)")
    ph = phases(quick)
    sched = build_schedule(load_trace(), ph, cap.rps, mix)
    slow_at = sched.bounds["slow"][0]
    events = [(slow_at, {"slowdown": {"factor": FACTOR, "seconds": SLOW_S}})]
    out = SlowdownRun(cap, sched)
    for key in configs:
        r, _ = headline.run_config(key, workdir / "slowdown", sched, cap, "preempt", 6.0, log, events)
        r.name = NAMES[key] + " under a decode slowdown"
        out.runs[key] = r
    return out


def _itl(r: Any) -> float | None:
    if not r.ok or r.first is None or r.end is None or r.tokens < 2:
        return None
    return (r.end - r.first) / (r.tokens - 1)


def rows(s: SlowdownRun) -> list[list[object]]:
    from bench.report import ms

    out: list[list[object]] = []
    for run in s.runs.values():
        if run.error:
            out.append([run.name, f"did not run: {run.error}"] + [""] * 8)
            continue
        for tier in TIERS:
            for phase in ("before", "slow", "after"):
                rs = [r for r in run.results if r.tier == tier and r.phase == phase]
                st = tier_stats(rs)
                itls = [x for r in rs if (x := _itl(r)) is not None]
                out.append([run.name, tier, phase, st.sent, st.ok, st.rejected_429 + st.rejected_503,
                            st.degraded, st.gave_up, f"{ms(st.ttft_p50)} / {ms(st.ttft_p99)}",
                            f"{ms(pct(itls, .5))} / {ms(pct(itls, .99))}"])
    return out


def verdicts(s: SlowdownRun) -> list[list[object]]:
    from bench.report import ms, verdict

    slo = SLOS["premium"]["ttft_p99_ms"]
    out: list[list[object]] = []
    for key, run in s.runs.items():
        if run.error:
            continue
        prem = tier_stats([r for r in run.results if r.tier == "premium" and r.phase == "slow"])
        free = [r for r in run.results if r.tier == "free" and r.phase == "slow"]
        free_hit = sum(1 for r in free if not r.ok or r.degraded) / max(1, len(free))
        prem_hit = (prem.sent - prem.ok + prem.degraded) / max(1, prem.sent)
        out.append([f"{run.name}: premium TTFT p99 in the slow phase <= {slo} ms",
                    f"{ms(prem.ttft_p99)} ms", verdict(None if math.isnan(prem.ttft_p99) else
                                                       prem.ttft_p99 * 1000 <= slo)])
        out.append([f"{run.name}: free degraded or refused before premium",
                    f"free {free_hit:.0%}, premium {prem_hit:.0%} not served as asked",
                    verdict(free_hit > prem_hit) if key == "f" else "n/a"])
    return out


def markdown(s: SlowdownRun) -> str:
    from bench.report import table

    p = ", ".join(f"{ph.name} {ph.seconds:.0f} s" for ph in s.schedule.phases)
    lines = [
        "## Slowdown: decode speed halved, KV unchanged",
        "",
        f"Chat only (premium and free), {LOAD:g}x the capacity measured in this run ({s.capacity.rps:.2f} req/s, "
        f"{s.capacity.tok_s:.0f} completion tokens/s); phases {p}; in the slow phase every decode step of the "
        f"simulated engine takes {FACTOR:g}x as long. (f)'s premium SLOs: {SLOS['premium']}. TTFT is "
        "client-side (queue wait included), ITL = (end - first token) / (tokens - 1); p50 / p99 in ms.",
        "",
        table(["configuration", "tier", "phase", "sent", "ok", "refused", "degraded", "gave up", "TTFT",
               "ITL"], rows(s)),
        "",
        table(["target", "measured", "verdict"], verdicts(s)),
    ]
    for run in s.runs.values():
        for note in run.notes:
            lines += ["", f"{run.name}: {note}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    import tempfile

    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory(prefix="sluice-slowdown-") as d:
        print(markdown(run(Path(d), quick=quick, log=lambda m: print(m, file=sys.stderr, flush=True))))
