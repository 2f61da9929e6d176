"""The tables of ``bench.overhead``: measurements turned into rows, and rows into
markdown. Rows hold raw numbers so ``--json`` keeps what the tables round.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.overhead_load import Sample, pct

CONFIGS = ("a", "b", "c")
HOST = "d"  # --host: the whole host, Sluice --workers 2 on Redis behind an Envoy with 2 workers
BASELINE = "e"  # --baseline-tree: Sluice and its Envoy config from another checkout
GRPCIO = "f"  # --grpcio: Sluice as (c), its port served by grpc.aio instead of extproc.wire.h2grpc
NAMES = {"a": "(a) Envoy alone", "b": "(b) Envoy + pass-through ext_proc", "c": "(c) Envoy + Sluice",
         HOST: "(d) the host: Envoy + Sluice workers on Redis", BASELINE: "(e) Envoy + Sluice, baseline checkout",
         GRPCIO: "(f) Envoy + Sluice on grpc.aio"}
TARGET_P50_MS, TARGET_P99_MS, TARGET_RPS_RATIO = 0.8, 2.0, 0.80
TARGET_RPS_PROCESS, TARGET_RPS_HOST = 2000, 2500


@dataclass(frozen=True)
class Row:
    """One line of one table; ``values`` holds raw numbers (JSON-friendly)."""
    table: str
    label: str
    values: dict[str, Any] = field(default_factory=dict)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _http_rows(one: dict[str, list[Sample]], many: dict[str, list[Sample]], conns: int, rounds: int) -> list[Row]:
    rows = []
    for n, samples in ((1, one), (conns, many)):
        p50 = {c: _med([pct(s.latencies_ns, .5) for s in samples[c]]) for c in samples}
        p99 = {c: _med([pct(s.latencies_ns, .99) for s in samples[c]]) for c in samples}
        for c in samples:
            v: dict[str, Any] = {"connections": n, "p50_ms": p50[c], "p99_ms": p99[c],
                                 "requests": sum(len(s.latencies_ns) for s in samples[c]),
                                 "errors": sum(s.errors for s in samples[c]), "rounds": rounds}
            if c != "a":
                v.update(added_p50_over_a=p50[c] - p50["a"], added_p99_over_a=p99[c] - p99["a"])
            if c in ("c", HOST, BASELINE, GRPCIO):
                v.update(added_p50_over_b=p50[c] - p50["b"], added_p99_over_b=p99[c] - p99["b"])
            rows.append(Row("latency", NAMES[c], v))
    rps = {c: _med([s.rps for s in many[c]]) for c in many}
    # Each round measured (b) and (c) seconds apart, so their ratio is steadier than either rate.
    ratios = [c.rps / b.rps for b, c in zip(many["b"], many["c"], strict=True) if b.rps]
    for c in many:
        v = {"connections": conns, "rps": rps[c]}
        if c == "c":
            v.update(ratio_c_over_b=_med(ratios), ratio_rounds=ratios)
        rows.append(Row("throughput", NAMES[c], v))
    return rows


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs) if xs and statistics.median(xs) else 0.0


def _noise_rows(one: dict[str, list[Sample]], many: dict[str, list[Sample]], conns: int,
                others: float, elapsed: float) -> list[Row]:
    rows = []
    for c in one:
        p50s = [pct(s.latencies_ns, .5) for s in one[c]]
        p99s = [pct(s.latencies_ns, .99) for s in one[c]]
        rpss = [s.rps for s in many[c]]
        rows.append(Row("noise", NAMES[c], {"p50_ms_rounds": p50s, "p99_ms_rounds": p99s, "rps_rounds": rpss,
                                            "p50_spread": _spread(p50s), "rps_spread": _spread(rpss)}))
    rows.append(Row("noise_note", "others", {"cpu_share": others, "seconds": elapsed}))
    return rows


_HIST = re.compile(r'^sluice_extproc_phase_seconds_(sum|count|bucket)\{(.*)\} ([0-9.e+-]+|\+Inf)$')
Hist = dict[str, dict[str, float]]  # phase -> {"sum", "count", "le=<bound>"...}


def parse_phase_histogram(metrics_text: str) -> Hist:
    out: Hist = {}
    for line in metrics_text.splitlines():
        m = _HIST.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = f"le={float(labels['le'])}" if m.group(1) == "bucket" else m.group(1)
            out.setdefault(labels.get("phase", "?"), {})[key] = float(m.group(3))
    return out


def _hist_add(total: Hist, before: Hist, after: Hist) -> None:
    for phase, values in after.items():
        acc = total.setdefault(phase, {})
        for k, v in values.items():
            acc[k] = acc.get(k, 0.0) + v - before.get(phase, {}).get(k, 0.0)


def phase_rows(by_load: dict[str, Hist]) -> list[Row]:
    """Mean and median bucket of Sluice's handler time per ext_proc message, per load level."""
    rows = []
    phases = sorted({p for h in by_load.values() for p in h}, key=lambda p: _PHASE_ORDER.get(p, 9))
    for phase in phases:
        values: dict[str, Any] = {}
        for load, h in by_load.items():
            d = h.get(phase, {})
            count = d.get("count", 0.0)
            if count:
                bounds = sorted((float(k[3:]), v) for k, v in d.items() if k.startswith("le="))
                values[load] = {"messages": int(count), "mean_us": d["sum"] / count * 1e6,
                                "p50_le_us": next((le for le, n in bounds if n >= count / 2), math.inf) * 1e6}
        if values:
            rows.append(Row("sluice_phases", phase, values))
    return rows


_PHASE_ORDER = {"request_headers": 0, "request_body": 1, "response_headers": 2, "response_body": 3,
                "response_trailers": 4}
_LOG_PHASES = (("request_header_latency_us", "request headers"), ("request_body_total_latency_us", "request body"),
               ("response_header_latency_us", "response headers"), ("response_body_total_latency_us", "response body"),
               ("response_trailer_latency_us", "response trailers"))


def _epoch(start_time: str) -> float:
    return datetime.fromisoformat(start_time).timestamp()


def access_log_rows(logs: dict[str, Path], windows: dict[str, list[tuple[float, float]]]) -> list[Row]:
    """Median per-message ext_proc round trip as Envoy saw it (its access log's filter state),
    over the requests that started within ``windows`` (wall-clock spans of the 1-connection
    runs: the log keeps the path without its query, so requests carry no tag there)."""
    per: dict[str, dict[str, list[int]]] = {}
    for c in ("b", "c"):
        per[c] = {k: [] for k, _ in _LOG_PHASES}
        spans = windows.get(c, [])
        with logs[f"envoy-{c}"].open() as fh:
            for line in fh:
                if not line.startswith("{"):
                    continue
                entry = json.loads(line)
                t = _epoch(entry.get("start_time") or "1970-01-01T00:00:00Z")
                if not any(a <= t <= b for a, b in spans):
                    continue
                ep = entry.get("ext_proc") or {}
                for k, _ in _LOG_PHASES:
                    if isinstance(ep.get(k), int):
                        per[c][k].append(ep[k])
    rows = []
    for k, label in _LOG_PHASES:
        b, c = per["b"][k], per["c"][k]
        if b and c:
            rows.append(Row("envoy_ext_proc", label, {"b_us": statistics.median(b), "c_us": statistics.median(c),
                                                      "added_us": statistics.median(c) - statistics.median(b)}))
    return rows


def _f(x: float, nd: int = 2, sign: bool = False) -> str:
    return "n/a" if x != x else (f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in body)]


def render_markdown(rows: list[Row]) -> str:
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.table, []).append(r)
    out: list[str] = []
    if "context" in by:
        out += ["### Machine", ""] + [f"- {r.label}: {r.values['value']}" for r in by["context"]] + [""]
    if "latency" in by:
        lat = by["latency"]
        out += ["### Added latency: small non-streaming chat completion (~200-byte body)", ""]
        body = []
        for r in lat:
            v = r.values
            add_a = (f"{_f(v['added_p50_over_a'], sign=True)} / {_f(v['added_p99_over_a'], sign=True)}"
                     if "added_p50_over_a" in v else "")
            add_b = (f"{_f(v['added_p50_over_b'], sign=True)} / {_f(v['added_p99_over_b'], sign=True)}"
                     if "added_p50_over_b" in v else "")
            body.append([str(v["connections"]), r.label, _f(v["p50_ms"]), _f(v["p99_ms"]), add_a, add_b,
                         f"{v['requests']:,}" + (f" ({v['errors']} errors)" if v["errors"] else "")])
        out += _table(["conns", "config", "p50 ms", "p99 ms", "added over (a), p50 / p99 ms",
                       "(c) over (b), p50 / p99 ms", "requests measured"], body)
        c1 = next((r.values for r in lat if r.label == NAMES["c"] and r.values["connections"] == 1), None)
        if c1:
            out += ["", f"Target, 1 connection: Sluice adds ≤ {TARGET_P50_MS} ms p50 over Envoy alone: "
                    f"{_f(c1['added_p50_over_a'], sign=True)} ms, {_verdict(c1['added_p50_over_a'] <= TARGET_P50_MS)}; "
                    f"≤ {TARGET_P99_MS} ms p99: {_f(c1['added_p99_over_a'], sign=True)} ms, "
                    f"{_verdict(c1['added_p99_over_a'] <= TARGET_P99_MS)}."]
        out += [""]
    if "throughput" in by:
        tp = by["throughput"]
        out += [f"### Requests/s at {tp[0].values['connections']} connections", ""]
        out += _table(["config", "requests/s", "(c) / (b)"],
                      [[r.label, f"{r.values['rps']:,.0f}",
                        _f(r.values["ratio_c_over_b"]) if "ratio_c_over_b" in r.values else ""] for r in tp])
        cv = next((r.values for r in tp if "ratio_c_over_b" in r.values), None)
        if cv is not None:
            ratio = cv["ratio_c_over_b"]
            out += ["", "(c) / (b) is the median of the per-round ratios "
                    f"({', '.join(_f(x) for x in cv['ratio_rounds'])}); requests/s are medians over rounds."]
            if "ratio_from_cpu" in cv:
                out += ["CPU time per request of the ext_proc server (table below; steadier than req/s under "
                        f"background load), pass-through / Sluice: {_f(cv['ratio_from_cpu'])}. The req/s ratio "
                        "tends to it when the ext_proc server is the bottleneck."]
            out += ["", f"Target: Sluice keeps ≥ {TARGET_RPS_RATIO:.0%} of the pass-through ext_proc's "
                    f"requests/s: {ratio:.0%}, {_verdict(ratio >= TARGET_RPS_RATIO)}."]
        rps = {r.label: r.values["rps"] for r in tp}
        if NAMES["c"] in rps:
            out += [f"Target: ≥ {TARGET_RPS_PROCESS:,} req/s for one Sluice process: {rps[NAMES['c']]:,.0f}, "
                    f"{_verdict(rps[NAMES['c']] >= TARGET_RPS_PROCESS)}."]
        if NAMES[HOST] in rps:
            out += [f"Target: ≥ {TARGET_RPS_HOST:,} req/s for the host (--workers 2 + Redis): "
                    f"{rps[NAMES[HOST]]:,.0f}, {_verdict(rps[NAMES[HOST]] >= TARGET_RPS_HOST)}."]
        out += [""]
    if "messages" in by:
        out += ["### ext_proc messages per request (16 connections, Envoy's counters)", "",
                "Sent and received on the ext_proc streams, and the streams opened, divided by the requests "
                "served. A blocking round trip is a message whose answer the request waits for; the "
                "request body's chunks are sent without waiting for the headers' answer and answered "
                "right after it, so they add messages, not waits.", ""]
        out += _table(["config", "sent", "received", "streams", "access-log entries", "blocking round trips"],
                      [[r.label, _f(r.values["sent"]), _f(r.values["received"]), _f(r.values["streams"]),
                        _f(r.values.get("logged", 0.0)), str(r.values["blocking"])] for r in by["messages"]]) + [""]
    if "cpu" in by:
        keys = ["loadgen", "envoy", "ext_proc", "backend", "redis"]
        out += ["### CPU time per request served at 16 connections (µs)", "",
                "All processes share the same 2 cores. (a)'s rate is what one Envoy worker and the rest of "
                "the stack reach here: context, not a target.", ""]
        body = []
        for r in by["cpu"]:
            v = {("envoy" if k.startswith("envoy") else "ext_proc" if k.startswith(("sluice", "passthrough"))
                  else k): x for k, x in r.values.items()}
            body.append([r.label, *(_f(v[k], 0) if k in v else "–" for k in keys), _f(sum(v.values()), 0)])
        out += _table(["config", "load generator", "Envoy", "ext_proc server", "backend", "Redis", "total"],
                      body) + [""]
    if "envoy_ext_proc" in by:
        out += ["### ext_proc round trips as Envoy saw them (1 connection, median µs per message)", "",
                "From the `ext_proc` filter state in Envoy's access log: the time from sending a message "
                "to the ext_proc server until its answer arrived. With the request side in one round trip "
                "the headers' answer waits for the body, so their latency is the request's whole wait; the "
                "body's chunks are answered right after it.", ""]
        out += _table(["message", "(b) pass-through", "(c) Sluice", "added"],
                      [[r.label, _f(r.values["b_us"], 0), _f(r.values["c_us"], 0), _f(r.values["added_us"], 0, True)]
                       for r in by["envoy_ext_proc"]]) + [""]
    if "sluice_phases" in by:
        loads = list(dict.fromkeys(k for r in by["sluice_phases"] for k in r.values))
        out += ["### Sluice's `sluice_extproc_phase_seconds` per ext_proc message (measured phases and "
                "their warm-ups)", "",
                "Timed from the message's arrival in `StreamProcessor.handle` (or `handle_body`) to its "
                "answer: the handler alone, not gRPC sending it.", ""]
        body = []
        for r in by["sluice_phases"]:
            cells = [r.label]
            for load in loads:
                v = r.values.get(load)
                cells.append(f"{_f(v['mean_us'], 0)} (≤ {_f(v['p50_le_us'], 0)})" if v else "")
            body.append(cells)
        out += _table(["phase", *(f"{load}: mean µs (median bucket)" for load in loads)], body) + [""]
    if "protobuf" in by:
        out += ["### Protobuf: parse + serialize one ProcessingRequest", ""]
        out += _table(["message", "bytes", "betterproto2 (envoy-data-plane) µs", "upb (xds-protos) µs", "ratio"],
                      [[r.label, str(r.values["bytes"]), _f(r.values["betterproto2_us"], 1), _f(r.values["upb_us"], 2),
                        f"{r.values['ratio']:.0f}×"] for r in by["protobuf"]]) + [""]
    if "noise" in by:
        out += ["### Noise: per-round values (tables above show the medians)", ""]
        out += _table(["config", "1 conn p50 ms", "1 conn p99 ms", "16 conns req/s", "p50 spread", "req/s spread"],
                      [[r.label, ", ".join(_f(x) for x in r.values["p50_ms_rounds"]),
                        ", ".join(_f(x) for x in r.values["p99_ms_rounds"]),
                        ", ".join(f"{x:,.0f}" for x in r.values["rps_rounds"]),
                        f"{r.values['p50_spread']:.0%}", f"{r.values['rps_spread']:.0%}"] for r in by["noise"]])
        for r in by.get("noise_note", []):
            out += ["", f"Spread is (max − min) / median over rounds. Other processes on the machine used "
                    f"{r.values['cpu_share']:.0%} of its CPU during the {r.values['seconds']:.0f} s of measurement."]
        out += [""]
    return "\n".join(out).rstrip() + "\n"
