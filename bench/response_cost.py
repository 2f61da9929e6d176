"""What a streamed response costs the gateway, per SSE event and per request.

    python -m bench.response_cost          # ~2 minutes; markdown on stdout, progress on stderr

For 16 concurrent streams of 200 and of 1,000 tokens (one SSE event per token, 20 ms
apart, from ``bench.pacedbackend``; the client does not ask for usage) it measures the
CPU that Envoy and the ext_proc server spend, for three gateways side by side:

    alone     Envoy alone: Sluice's bootstrap without the ext_proc filter
    streamed  Envoy + Sluice, ``response_processing: streamed`` (every chunk to Python)
    trailers  Envoy + Sluice, ``response_processing: usage_trailers`` (the default)

CPU is each process's total CPU time (all threads) from the kernel's per-process CPU
clock (``clock_gettime`` on the pid's clock id: the count /proc/PID/stat reports in
10 ms ticks, to the nanosecond), over the run, minus the same process's idle rate
measured over 5 s before the first run. The three gateways run side by side, each with its own Envoy
(``--concurrency 1``) and Sluice process, their streams at the same time, so load from
other processes on the machine lands on all three alike; each figure is the median over
``--rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.procs import ProcGroup, free_port, http_ok, tcp_open

MODEL = "paced"
KEY = "sk-bench-paced"
CONFIGS = {"alone": "Envoy alone (no ext_proc)", "streamed": "Sluice, response body STREAMED (old)",
           "trailers": "Sluice, usage_trailers (new default)"}


def cpu_ns(pid: int) -> int:
    """Total CPU time of process ``pid`` (every thread, exited ones too), in ns."""
    return time.clock_gettime_ns((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def policy(port: int) -> dict[str, Any]:
    from extproc.policy.schema import hash_key

    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 256, "message_timeout_ms": 5000},
        "backends": [{"name": "paced", "address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
                      "max_concurrency": 4096,
                      # Few idle timers: their CPU is subtracted, and its noise would swamp
                      # the ~1 ms a request costs on the usage_trailers path.
                      "watermark": {"scrape_interval_s": 20, "stale_after_s": 600},
                      "models": [{"name": MODEL, "context_window": 8192, "encoding": "cl100k_base"}]}],
        "tiers": {"bench": {"priority": 100, "tpm": 10_000_000_000, "rpm": 1_000_000_000, "max_concurrency": 100_000}},
        "tenants": [{"name": "bench", "tier": "bench", "keys": [hash_key(KEY)]}],
    }


@dataclass
class Result:
    config: str
    tokens: int
    requests: int
    events: int  # SSE events the backend sent (the usage chunk included where asked)
    seconds: float
    envoy_ns: float  # idle subtracted
    extproc_ns: float
    messages: float  # ext_proc messages per request
    leaked_usage: bool
    ok: int
    added_ns: float = 0.0  # Envoy ns/event over Envoy alone: median of the per-round differences


CLIENT_USAGE = False  # --client-usage: clients ask for the usage chunk (nothing for Lua to hide)


async def _one(port: int, tokens: int, interval_ms: int) -> tuple[int, bool, bool]:
    doc: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": tokens + 8,
                           "messages": [{"role": "user", "content": "count to a thousand"}]}
    if CLIENT_USAGE:
        doc["stream_options"] = {"include_usage": True}
    body = json.dumps(doc).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nx-paced-events: {tokens}\r\n"
            f"x-paced-interval-ms: {interval_ms}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
    writer.close()
    ok = data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data
    return data.count(b"data: {"), ok, not CLIENT_USAGE and b'"usage":{' in data


async def _burst(port: int, streams: int, tokens: int, interval_ms: int) -> list[tuple[int, bool, bool]]:
    return await asyncio.gather(*(_one(port, tokens, interval_ms) for _ in range(streams)))


class Bench(ProcGroup):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.backend_port = free_port()
        self.grpc = {c: free_port() for c in CONFIGS if c != "alone"}
        self.admin = {c: free_port() for c in CONFIGS if c != "alone"}
        self.listen = {c: free_port() for c in CONFIGS}
        self.envoy_admin = {c: free_port() for c in CONFIGS}

    def start(self) -> None:
        from bench.overhead import strip_ext_proc
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        py = sys.executable
        self.start_proc("backend", [py, "-m", "bench.pacedbackend", "--port", str(self.backend_port)],
                        lambda: tcp_open(self.backend_port))
        pol = self.dir / "policies"
        pol.mkdir()
        (pol / "policy.yaml").write_text(yaml.safe_dump(policy(self.backend_port), sort_keys=False))
        for c, port in self.grpc.items():
            admin = self.admin[c]
            self.start_proc(f"sluice-{c}", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                            f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
                                            "--reload-interval", "60"],
                            lambda admin=admin: http_ok(f"http://127.0.0.1:{admin}/healthz"))
        for c in CONFIGS:
            opts = EnvoyOptions(listen_port=self.listen[c], admin_port=self.envoy_admin[c],
                                extproc_port=self.grpc.get(c, 1),
                                message_timeout_ms=5000, access_log=False,
                                response_processing="usage_trailers" if c == "trailers" else "streamed")
            cfg = render_bootstrap([BackendRoute("paced", "127.0.0.1", self.backend_port)], opts)
            if c == "alone":
                cfg = strip_ext_proc(cfg)
            self.start_envoy(f"envoy-{c}", cfg, self.envoy_admin[c], 1)

    def messages(self, c: str) -> float:
        if c == "alone":
            return 0.0
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin[c]}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(m) for m in re.findall(r"^sluice_extproc_phase_seconds_count\{[^}]*\} (\S+)$", text, re.M))

    def pids(self, c: str) -> dict[str, int]:
        out = {"envoy": self.procs[f"envoy-{c}"].pid}
        if c != "alone":
            out["extproc"] = self.procs[f"sluice-{c}"].pid
        return out

    def all_pids(self) -> dict[tuple[str, str], int]:
        return {(c, k): p for c in CONFIGS for k, p in self.pids(c).items()}

    def idle_rates(self, seconds: float) -> dict[tuple[str, str], float]:
        """CPU ns per second each process spends with no traffic (timers, scrapes, stats)."""
        pids = self.all_pids()
        t0, idle0 = time.monotonic(), {k: cpu_ns(p) for k, p in pids.items()}
        time.sleep(seconds)
        return {k: (cpu_ns(p) - idle0[k]) / (time.monotonic() - t0) for k, p in pids.items()}

    def measure(self, streams: int, tokens: int, interval_ms: int,
                idle_rate: dict[tuple[str, str], float]) -> list[Result]:
        """One round: every gateway's streams at once."""
        pids = self.all_pids()
        msgs0 = {c: self.messages(c) for c in CONFIGS}
        t1, before = time.monotonic(), {k: cpu_ns(p) for k, p in pids.items()}

        async def all_at_once() -> list[list[tuple[int, bool, bool]]]:
            return await asyncio.gather(*(_burst(self.listen[c], streams, tokens, interval_ms) for c in CONFIGS))

        got = dict(zip(CONFIGS, asyncio.run(all_at_once()), strict=True))
        elapsed = time.monotonic() - t1
        used = {k: max(0.0, cpu_ns(p) - before[k] - idle_rate[k] * elapsed) for k, p in pids.items()}
        out = []
        for c in CONFIGS:
            events = streams * (tokens + (0 if c == "alone" else 1))  # Sluice asks for the usage chunk
            out.append(Result(c, tokens, streams, events, elapsed, used[(c, "envoy")], used.get((c, "extproc"), 0.0),
                              (self.messages(c) - msgs0[c]) / streams, any(leak for _, _, leak in got[c]),
                              sum(ok for _, ok, _ in got[c])))
        return out


def median_result(rs: list[Result]) -> Result:
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    r0 = rs[0]
    return Result(r0.config, r0.tokens, r0.requests, r0.events, med([r.seconds for r in rs]),
                  med([r.envoy_ns for r in rs]), med([r.extproc_ns for r in rs]), med([r.messages for r in rs]),
                  any(r.leaked_usage for r in rs), min(r.ok for r in rs))


def render(results: list[Result], load: tuple[float, float], rounds: int) -> str:
    out = [
        f"{results[0].requests} concurrent streams per gateway, one SSE event per token, 20 ms apart; "
        "load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} ({os.cpu_count()} cores)",
        "",
        "| gateway | tokens | ok | Envoy µs/event | Envoy µs/event over alone | extproc µs/event | "
        "extproc ms/request | ext_proc msgs/request | usage chunk hidden |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        env = r.envoy_ns / r.events / 1000
        extra = "–" if r.config == "alone" else f"{r.added_ns / 1000:+.1f}"
        ext = "–" if r.config == "alone" else f"{r.extproc_ns / r.events / 1000:.1f}"
        per_req = "–" if r.config == "alone" else f"{r.extproc_ns / r.requests / 1e6:.2f}"
        msgs = "–" if r.config == "alone" else f"{r.messages:.1f}"
        hidden = "–" if r.config == "alone" else ("no" if r.leaked_usage else "yes")
        out.append(f"| {CONFIGS[r.config]} | {r.tokens} | {r.ok}/{r.requests} | {env:.1f} | {extra} | {ext} | "
                   f"{per_req} | {msgs} | {hidden} |")
    new = {r.tokens: r for r in results if r.config == "trailers"}
    if len(new) == 2:
        short, long_ = sorted(new)
        ratio = (new[long_].extproc_ns / new[long_].requests) / max(new[short].extproc_ns / new[short].requests, 1)
        per_event = new[long_].extproc_ns / new[long_].events / 1000
        added = max(new[t].added_ns for t in new) / 1000
        out += ["", f"usage_trailers: extproc CPU per request, {long_} vs {short} tokens: {ratio:.2f}x "
                f"(target <= 1.2x); extproc {per_event:.1f} µs/event at {long_} tokens (target <= 10); "
                f"Envoy +{added:.1f} µs/event over Envoy alone at worst (target <= 20)"]
    out.append(f"(median of {rounds} rounds; the three gateways streamed side by side in each)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.response_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--interval-ms", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU measured this long, once, before the runs")
    ap.add_argument("--keep", action="store_true", help="keep configs and logs")
    ap.add_argument("--client-usage", action="store_true",
                    help="clients ask for the usage chunk themselves (Envoy's Lua filter then has nothing to do)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    global CLIENT_USAGE
    CLIENT_USAGE = args.client_usage
    load = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="sluice-response-cost-"))
    b = Bench(workdir)
    results: list[Result] = []
    try:
        print(f"starting the paced backend, Sluice and 3 Envoys in {workdir}", file=sys.stderr, flush=True)
        b.start()
        for c in CONFIGS:  # warm every path once (connections, first-use allocations)
            asyncio.run(_burst(b.listen[c], 2, 5, 1))
        idle = b.idle_rates(args.idle_s)
        for tokens in args.tokens:
            rounds: dict[str, list[Result]] = {c: [] for c in CONFIGS}
            for i in range(args.rounds):
                for r in b.measure(args.streams, tokens, args.interval_ms, idle):
                    rounds[r.config].append(r)
                    print(f"round {i + 1} {r.config:9} {tokens:5} tokens: envoy {r.envoy_ns / r.events / 1000:6.1f}"
                          f" µs/event, extproc {r.extproc_ns / r.events / 1000:6.1f} µs/event, "
                          f"{r.ok}/{r.requests} ok, {r.seconds:.1f} s", file=sys.stderr, flush=True)
            for c in CONFIGS:
                m = median_result(rounds[c])
                # Paired per round (the gateways ran side by side), then the median.
                m.added_ns = statistics.median(r.envoy_ns / r.events - a.envoy_ns / a.events
                                               for r, a in zip(rounds[c], rounds["alone"], strict=True))
                results.append(m)
    finally:
        b.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(render(results, (load[0], load[1]), args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
