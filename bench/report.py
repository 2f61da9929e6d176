"""The headline's tables and plots, and the markdown helpers the other parts share."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.headline import FALLBACK_MODEL, SLO_TTFT_MS, ConfigRun, Headline
from bench.loadgen import Result
from bench.metrics import open_streams, tier_stats, tokens_between
from bench.sampler import Sample

TIERS = ("premium", "free", "batch")


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def ms(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x * 1000:.0f}" if x < 10 else f"{x:.1f} s"


def frac(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.0%}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "**missed**"


def _counter_at(samples: Sequence[Sample], t: float, attr: str) -> int | None:
    """The counter's value at the last sample taken at or before t (the first one if none)."""
    vals = [(s.t, getattr(s, attr)) for s in samples if getattr(s, attr) is not None]
    if not vals:
        return None
    before = [v for ts, v in vals if ts <= t]
    return before[-1] if before else vals[0][1]


def counter_delta(samples: Sequence[Sample], a: float, b: float, attr: str) -> int | None:
    lo, hi = _counter_at(samples, a, attr), _counter_at(samples, b, attr)
    return None if lo is None or hi is None else hi - lo


def main_backend(results: Sequence[Result]) -> list[Result]:
    return [r for r in results if r.model != FALLBACK_MODEL]


def goodput(run: ConfigRun, h: Headline, phase: str, fallback: bool = False) -> float:
    a, b = h.schedule.bounds[phase]
    rs = [r for r in run.results if (r.model == FALLBACK_MODEL) == fallback]
    return tokens_between(rs, a, b) / (b - a) / h.capacity.tok_s


def in_phase(results: Sequence[Result], phase: str, tier: str | None = None) -> list[Result]:
    return [r for r in results if r.phase == phase and (tier is None or r.tier == tier)]


def _kv_mean(run: ConfigRun, h: Headline) -> float:
    xs = [s.kv_usage for s in run.samples if s.kv_usage is not None and s.t < h.schedule.seconds]
    return sum(xs) / len(xs) if xs else math.nan


def cpu_peak(samples: Sequence[Sample], proc: str, span: float = 1.0) -> float:
    """Highest CPU use of ``proc`` (cores) over any ~``span`` seconds between samples."""
    pts = [(s.t, s.cpu[proc]) for s in samples if proc in s.cpu and not math.isnan(s.cpu[proc])]
    best, j = math.nan, 0
    for i in range(len(pts)):
        while j < len(pts) and pts[j][0] - pts[i][0] < span:
            j += 1
        if j < len(pts):
            rate = (pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0])
            best = rate if math.isnan(best) else max(best, rate)
    return best


def config_rows(h: Headline) -> list[list[object]]:
    burst = h.schedule.bounds["burst"]
    rows = []
    for key, run in h.runs.items():
        if run.error:
            rows.append([run.name, f"did not run: {run.error}"] + [""] * 13)
            continue
        pre = counter_delta(run.samples, burst[0], burst[1] + 2.0, "preemptions")
        st = tier_stats(run.results)
        cpu = {"c": "litellm", "d": "extproc", "e": "extproc", "f": "extproc"}.get(key, "envoy")
        fb = sum(1 for r in run.results if r.model == FALLBACK_MODEL and r.ok)
        extra = f" (+{frac(goodput(run, h, 'burst', True))} via fallback, {fb} req)" if fb else ""
        waiting = max((x.waiting for x in run.samples if x.waiting is not None), default=0)
        rows.append([run.name, f"{run.engine.get('preemptions_total', '?')} / {pre}", waiting,
                     run.engine.get("oom_failures_total", "?"),
                     frac(run.engine["kv_blocks_peak"] / run.engine["kv_blocks_total"]), frac(_kv_mean(run, h)),
                     frac(goodput(run, h, "steady")), frac(goodput(run, h, "burst")) + extra,
                     frac(goodput(run, h, "recovery")), st.rejected_429, st.rejected_503, st.gave_up,
                     st.unfinished, st.degraded,
                     f"{run.cpu.get(cpu, math.nan):.2f} / {cpu_peak(run.samples, cpu):.2f} ({cpu})"])
    return rows


def tier_rows(h: Headline) -> list[list[object]]:
    rows = []
    for run in h.runs.values():
        if run.error:
            continue
        for tier in TIERS:
            rs = [r for r in run.results if r.tier == tier]
            s, sb, ss = tier_stats(rs), tier_stats(in_phase(rs, "burst")), tier_stats(in_phase(rs, "steady"))
            rows.append(
                [
                    run.name,
                    tier,
                    s.sent,
                    s.ok,
                    s.rejected_429,
                    s.rejected_503,
                    s.gave_up,
                    s.unfinished,
                    s.other_errors,
                    s.degraded,
                    f"{ms(ss.ttft_p50)} / {ms(ss.ttft_p99)}",
                    f"{ms(sb.ttft_p50)} / {ms(sb.ttft_p99)}",
                    f"{ms(ss.e2e_p50)} / {ms(ss.e2e_p99)}",
                    f"{ms(sb.e2e_p50)} / {ms(sb.e2e_p99)}",
                ]
            )
    return rows


def reason_rows(h: Headline) -> list[list[object]]:
    rows = []
    for run in h.runs.values():
        for tier in TIERS:
            c = Counter(r.reason or (f"{r.status}" if r.status not in (0, 200) else "")
                        for r in run.results if r.tier == tier and r.status not in (0, 200))
            d = Counter(r.degraded for r in run.results if r.tier == tier and r.degraded)
            if c or d:
                rows.append([run.name, tier, ", ".join(f"{k} {v}" for k, v in c.most_common()) or "–",
                             ", ".join(f"{k} {v}" for k, v in d.most_common()) or "–"])
    return rows


def _refused(r: Result) -> bool:
    return not r.ok or bool(r.degraded)


def targets(h: Headline) -> list[list[object]]:
    d, a = h.runs.get("d"), h.runs.get("a")
    if d is None or d.error:
        return [["(d) did not run", "", "n/a"]]
    burst = h.schedule.bounds["burst"]
    pre_d = counter_delta(d.samples, burst[0], burst[1] + 2.0, "preemptions") or 0
    oom_d = counter_delta(d.samples, burst[0], burst[1] + 2.0, "oom_failures") or 0
    pre_a = (counter_delta(a.samples, burst[0], burst[1] + 2.0, "preemptions") or 0) if a and not a.error else None
    oom_a = (counter_delta(a.samples, burst[0], burst[1] + 2.0, "oom_failures") or 0) if a and not a.error else None
    shows = None if pre_a is None else (pre_a + (oom_a or 0)) > 0
    g = goodput(d, h, "burst")
    prem = [r for r in d.results if r.tier == "premium"]
    p_steady = tier_stats(in_phase(prem, "steady")).ttft_p99
    p_burst = tier_stats(in_phase(prem, "burst")).ttft_p99
    share = {t: (sum(1 for r in in_phase(d.results, "burst", t) if _refused(r)) /
                 max(1, len(in_phase(d.results, "burst", t)))) for t in TIERS}
    first = {t: min((r.sent for r in d.results if r.tier == t and _refused(r)), default=math.inf) for t in TIERS}
    slow = {t: tier_stats(in_phase(d.results, "burst", t)).ttft_p50 /
            tier_stats(in_phase(d.results, "steady", t)).ttft_p50 for t in TIERS}
    # Each lower tier must be pushed back more than premium: refused more often, or
    # queued longer (its TTFT grew more from steady to burst).
    order_ok = all(share[t] > share["premium"] or slow[t] > slow["premium"] for t in ("free", "batch"))
    a_steady = tier_stats(in_phase([r for r in a.results if r.tier == "premium"], "steady")).ttft_p99 \
        if a and not a.error else math.nan
    return [
        ["(d) zero preemptions and OOM failures through the burst, while (a) shows them",
         f"(d) {pre_d} preemptions, {oom_d} OOM; (a) {pre_a} preemptions, {oom_a} OOM",
         verdict(pre_d == 0 and oom_d == 0 and bool(shows))],
        ["(d) goodput during the burst >= 90 % of capacity", f"{g:.0%} (fallback adds "
         f"{goodput(d, h, 'burst', True):.0%})", verdict(g >= 0.9)],
        ["(d) premium p99 TTFT in the burst <= 2x steady", f"{ms(p_burst)} vs {ms(p_steady)} ms "
         f"({p_burst / p_steady:.1f}x); for reference (a)'s steady p99 is {ms(a_steady)} ms",
         verdict(p_burst <= 2 * p_steady)],
        ["(d) free and batch queued, degraded or shed before premium (each lower tier refused more "
         "often, or queued longer, than premium)",
         "not served as asked in the burst: " + ", ".join(f"{t} {share[t]:.0%}" for t in TIERS) +
         "; first refusal at " + (", ".join(f"{t} {first[t]:.1f} s" for t in TIERS if math.isfinite(first[t]))
                                  or "none") +
         "; TTFT p50 burst / steady (queueing): " + ", ".join(f"{t} {slow[t]:.1f}x" for t in TIERS),
         verdict(order_ok)],
    ]


def learned_targets(h: Headline) -> list[list[object]]:
    """The targets for (e) learned reservations and (f) learned + the SLO controller."""
    a = h.runs.get("a")
    burst = h.schedule.bounds["burst"]
    kv_a = _kv_mean(a, h) if a and not a.error else math.nan
    slo = SLO_TTFT_MS["premium"]
    rows: list[list[object]] = []
    for key in "ef":
        run = h.runs.get(key)
        if run is None or run.error:
            continue
        pre = counter_delta(run.samples, burst[0], burst[1] + 2.0, "preemptions") or 0
        oom = counter_delta(run.samples, burst[0], burst[1] + 2.0, "oom_failures") or 0
        kv = _kv_mean(run, h)
        g = goodput(run, h, "burst")
        p99 = tier_stats(in_phase([r for r in run.results if r.tier == "premium"], "burst")).ttft_p99
        rows += [
            [f"{run.name}: zero preemptions and OOM failures through the burst", f"{pre} preemptions, {oom} OOM",
             verdict(pre == 0 and oom == 0)],
            [f"{run.name}: mean KV usage within 10 points of (a)", f"{frac(kv)} vs (a) {frac(kv_a)}",
             verdict(None if math.isnan(kv_a) else kv >= kv_a - 0.10)],
            [f"{run.name}: goodput during the burst >= 95 % of capacity", f"{g:.0%}", verdict(g >= 0.95)],
            [f"{run.name}: premium p99 TTFT in the burst <= its SLO ({slo} ms; (e) has none, for comparison)",
             f"{ms(p99)} ms (client-side, queue wait included)", verdict(p99 * 1000 <= slo if key == "f" else None)],
        ]
    return rows or [["(e) and (f) did not run", "", "n/a"]]


def headline_markdown(h: Headline) -> str:
    cap, sched = h.capacity, h.schedule
    phases = ", ".join(f"{p.name} {p.seconds:.0f} s at {p.load:g}x" for p in sched.phases)
    counts = Counter(r.tier for r in sched.requests)
    out = [
        "## Headline: overload protection on real arrivals",
        "",
        f"Backend: simulated vLLM, {h.mode} mode, 2048 KV blocks x 16 = 32,768 tokens, 64 sequences, real time. "
        f"Capacity measured in this run: a closed loop of {cap.concurrency} clients of the same mix straight to a "
        f"fresh backend (1.5x the number whose mean KV footprint fills the cache, so the backend's own queue "
        f"keeps it full), {cap.seconds:.0f} s after warm-up: **{cap.tok_s:.0f} completion tokens/s, "
        f"{cap.rps:.2f} req/s**, {cap.preemptions} preemptions, KV peak {cap.kv_peak:.0%}.",
        "",
        f"Schedule: Azure LLM conversation trace 2023 (real arrival gaps, prompt and output lengths), "
        f"{phases} of that capacity; {len(sched.requests)} requests: "
        + ", ".join(f"{counts[t]} {t}" for t in TIERS) + ". Premium chat asks max_tokens 1024, free 512, "
        "batch documents (~16k-token prompts, long-context model) 1024; the backend generates the trace's "
        "lengths. Chat clients give up after 15 s without a token, batch after 60 s.",
        "",
        "Goodput: completion tokens/s streamed in successful responses, as a share of the capacity (a phase "
        "replays a different stretch of the trace than the capacity run's sample, so it can exceed 100 %). "
        "Gave up: the client's patience ran out (it closed its socket); open at end: still queued or "
        "streaming when the run stopped waiting (6 s after the last arrival).",
        "",
        table(["configuration", "preemptions (run / burst)", "backend queue peak", "OOM failures", "KV peak", "KV mean",
               "goodput steady", "goodput burst", "goodput recovery", "429", "503", "gave up",
               "open at end", "degraded", "limiter CPU, cores: mean / peak 1 s"], config_rows(h)),
        "",
        "Per tier (counts over the whole run; TTFT and end-to-end p50 / p99 in ms unless marked, "
        "successful responses):",
        "",
        table(["configuration", "tier", "sent", "ok", "429", "503", "gave up", "open at end", "other errors",
               "degraded",
               "TTFT steady", "TTFT burst", "e2e steady", "e2e burst"], tier_rows(h)),
        "",
        "Refusals and degradations by reason (`x-sluice-reason` / status; `x-sluice-degraded`):",
        "",
        table(["configuration", "tier", "refused", "degraded"], reason_rows(h)),
        "",
        "Targets, configuration (d):",
        "",
        table(["target", "measured", "verdict"], targets(h)),
        "",
        "Targets, configurations (e) learned KV reservations and (f) learned + latency SLO controller "
        "(premium TTFT within its SLO, batch goodput kept):",
        "",
        table(["target", "measured", "verdict"], learned_targets(h)),
    ]
    for run in h.runs.values():
        for note in run.notes:
            out += ["", f"{run.name}: {note}"]
    return "\n".join(out) + "\n"


def plot_headline(h: Headline, outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    colors = {"steady": "#e8f4e8", "burst": "#fbe3e3", "recovery": "#e6eefb"}
    for key, run in h.runs.items():
        if run.error or not run.samples:
            continue
        fig, ax = plt.subplots(figsize=(10, 4.8))
        for name, (a, b) in h.schedule.bounds.items():
            ax.axvspan(a, b, color=colors.get(name, "#eee"), alpha=0.7, lw=0)
            ax.text((a + b) / 2, 1.02, name, ha="center", fontsize=8)
        t = [s.t for s in run.samples]
        ax.plot(t, [s.kv_usage for s in run.samples], color="tab:red", lw=1.5, label="KV usage")
        if any(s.scale is not None for s in run.samples):
            ax.plot(t, [s.scale for s in run.samples], color="tab:purple", lw=1, ls="--", label="Sluice scale")
        ax.set_ylim(0, 1.08)
        ax.set_xlabel("seconds")
        ax.set_ylabel("KV cache usage")
        ax2 = ax.twinx()
        ax2.plot(t, [s.running for s in run.samples], color="tab:blue", lw=1, label="running")
        ax2.plot(t, [s.waiting for s in run.samples], color="tab:gray", lw=1, label="waiting (backend)")
        ax2.plot(t, [open_streams(run.results, x) for x in t], color="tab:orange", lw=1,
                 label="admitted (200 streams open)")
        if any(s.admitted is not None for s in run.samples):
            ax2.plot(t, [s.admitted for s in run.samples], color="tab:green", lw=1.5, label="admitted (Sluice slots)")
            ax2.plot(t, [s.queued for s in run.samples], color="tab:olive", lw=1, ls=":", label="queued (Sluice)")
        ax2.set_ylabel("requests")
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
        ax.legend(lines, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=7,
                  frameon=False)
        pre = run.engine.get("preemptions_total", 0)
        ax.set_title(f"{run.name}: KV usage, running and admitted requests ({pre} preemptions)", fontsize=10)
        fig.tight_layout()
        path = outdir / f"headline-{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def dump_raw(h: Headline, path: Path) -> Path:
    """Every request's outcome and every sample, for re-plotting or a second look."""
    doc = {
        "capacity": dataclasses.asdict(h.capacity),
        "phases": [dataclasses.asdict(p) for p in h.schedule.phases],
        "bounds": h.schedule.bounds,
        "mode": h.mode,
        "litellm_latency": h.litellm_latency,
        "runs": {k: {"name": r.name, "error": r.error, "engine": r.engine, "cpu": r.cpu, "rss_mb": r.rss_mb,
                     "notes": r.notes, "results": [dataclasses.asdict(x) for x in r.results],
                     "samples": [dataclasses.asdict(x) for x in r.samples]}
                 for k, r in h.runs.items()},
    }
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path
