"""What Sluice adds to a request: latency and throughput over Envoy alone and over a
pass-through ext_proc, plus betterproto2 vs upb protobuf costs.

    python -m bench.overhead            # ~2 minutes; markdown on stdout, progress on stderr

Three gateways run side by side on random loopback ports, all in front of the same
constant backend (``bench.fastbackend``), each Envoy with ``--concurrency 1``:

    (a) Envoy alone: the bootstrap from ``extproc.envoy.bootstrap.render_bootstrap`` with the
        ``envoy.filters.http.ext_proc`` entry removed from the HCM's ``http_filters`` and the
        ``sluice_extproc`` cluster removed (``strip_ext_proc``); everything else identical
    (b) Envoy + ``bench.passthrough_extproc`` (same bootstrap, an ext_proc that changes nothing)
    (c) Envoy + Sluice (``python -m extproc serve`` with a generated policy)

One Envoy worker each: the machine has 2 cores shared by the load generator, the backend,
the ext_proc server and Envoy, so a second worker would only compete for the same cores
(and one keep-alive connection only ever uses one worker).

The load generator runs in this process (the servers are child processes): asyncio
protocols on HTTP/1.1 keep-alive connections, prebuilt request bytes, parsing only the
status line and the content-length or chunked framing (Envoy streams the response body
through ext_proc, so (b) and (c) answer chunked). Rounds interleave the configurations
(a, b, c, then b, c, a, ...) and the tables show medians over rounds, so background load
from other processes lands on every configuration alike; the noise table says how much
the rounds disagreed and how much CPU other processes took meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from bench.overhead_load import BODY, KEY, MODEL, Sample, _drive, pct
from bench.overhead_report import (
    CONFIGS,
    NAMES,
    Hist,
    Row,
    _hist_add,
    _http_rows,
    _noise_rows,
    access_log_rows,
    parse_phase_histogram,
    phase_rows,
    render_markdown,
)
from bench.procs import ProcGroup, free_port, http_ok, tcp_open
from bench.procs import envoy_binary as _envoy_binary
from bench.protobench import protobuf_rows

__all__ = ["Row", "main", "render_markdown", "run"]


# -- processes ---------------------------------------------------------------------------
def envoy_binary() -> str:
    # SystemExit, not RuntimeError: bench.run's guard around each part lets it through, so
    # without Envoy the whole run stops rather than reporting this part as failed.
    try:
        return _envoy_binary()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def strip_ext_proc(cfg: dict[str, Any]) -> dict[str, Any]:
    """Config (a): drop the ext_proc HTTP filter and its cluster from a rendered bootstrap."""
    from extproc.envoy.bootstrap import EXTPROC_CLUSTER, EXTPROC_FILTER

    removed = 0
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                filters = f.get("typed_config", {}).get("http_filters")
                if filters is not None:
                    kept = [h for h in filters if h["name"] != EXTPROC_FILTER]
                    removed += len(filters) - len(kept)
                    f["typed_config"]["http_filters"] = kept
    if removed != 1:
        raise RuntimeError(f"expected one ext_proc filter in the bootstrap, found {removed}")
    res = cfg["static_resources"]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != EXTPROC_CLUSTER]
    return cfg


def bench_policy(backend_port: int) -> dict[str, Any]:
    from extproc.policy.schema import hash_key

    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 256, "message_timeout_ms": 5000},
        "backends": [{"name": "fast", "address": f"127.0.0.1:{backend_port}",
                      "metrics_url": f"http://127.0.0.1:{backend_port}/metrics", "max_concurrency": 4096,
                      "models": [{"name": MODEL, "context_window": 8192, "encoding": "cl100k_base"}]}],
        # ~100 tokens per request; these budgets are orders of magnitude above any run.
        "tiers": {"bench": {"priority": 100, "tpm": 10_000_000_000, "rpm": 1_000_000_000,
                            "max_concurrency": 100_000}},
        "tenants": [{"name": "bench", "tier": "bench", "keys": [hash_key(KEY)]}],
    }


class Stack(ProcGroup):
    """Backend, pass-through ext_proc, Sluice and three Envoys, all on random ports."""

    def __init__(self, workdir: Path, envoy_concurrency: int, response_processing: str = "usage_trailers") -> None:
        super().__init__(workdir)
        self.concurrency = envoy_concurrency
        self.response_processing = response_processing
        self.backend_port, self.pt_port, self.grpc_port, self.admin_port = (free_port() for _ in range(4))
        self.listen = {c: free_port() for c in CONFIGS}
        self.envoy_admin = {c: free_port() for c in CONFIGS}

    def start(self) -> None:
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        envoy_binary()  # without Envoy, stop the whole run here (SystemExit), not mid-stack
        py = sys.executable
        self.start_proc("backend", [py, "-m", "bench.fastbackend", "--port", str(self.backend_port)],
                        lambda: http_ok(f"http://127.0.0.1:{self.backend_port}/health"))
        self.start_proc("passthrough", [py, "-m", "bench.passthrough_extproc", "--grpc", f"127.0.0.1:{self.pt_port}"],
                        lambda: tcp_open(self.pt_port), "pass-through ext_proc")
        policy = self.dir / "policies"
        policy.mkdir()
        doc = bench_policy(self.backend_port)
        (policy / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        self.start_proc("sluice", [py, "-m", "extproc", "serve", "--policy", str(policy),
                                   "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}"],
                        lambda: http_ok(f"http://127.0.0.1:{self.admin_port}/healthz"))
        gw = doc["gateway"]
        for c in CONFIGS:
            opts = EnvoyOptions(listen_port=self.listen[c], admin_port=self.envoy_admin[c],
                                extproc_port=self.grpc_port if c == "c" else self.pt_port,
                                max_body_bytes=gw["max_body_bytes"], message_timeout_ms=gw["message_timeout_ms"],
                                # (a) has no ext_proc, so no usage filters either: the streamed shape
                                response_processing="streamed" if c == "a" else self.response_processing)
            cfg = render_bootstrap([BackendRoute("fast", "127.0.0.1", self.backend_port, (MODEL,))], opts)
            if c == "a":
                cfg = strip_ext_proc(cfg)
            self.start_envoy(f"envoy-{c}", cfg, self.envoy_admin[c], self.concurrency)

    def cpu_ticks(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """utime+stime (clock ticks) of each named child, and of this process as "loadgen"."""
        out = {}
        for name in names if names is not None else self.procs:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{self.procs[name].pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = int(fields[11]) + int(fields[12])
        t = os.times()
        out["loadgen"] = round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))
        return out

    def sluice_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5) as r:
            return r.read().decode()


def _machine_busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def context_rows(envoy_concurrency: int) -> list[Row]:
    import grpc
    from google.protobuf import __version__ as protobuf_version
    from google.protobuf.internal import api_implementation

    version = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"/(\d+\.\d+\.\d+)/", version)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    load = os.getloadavg()
    return [Row("context", k, {"value": v}) for k, v in [
        ("cores", f"{os.cpu_count()} ({cpu})"),
        ("python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("envoy", f"{m.group(1) if m else version.strip()} (--concurrency {envoy_concurrency}, one instance per config)"),
        ("grpcio / protobuf", f"{grpc.__version__} / {protobuf_version} ({api_implementation.Type()})"),
        ("load average at start", " ".join(f"{x:.2f}" for x in load)),
    ]]


# -- the run ----------------------------------------------------------------------------------
def run(*, rounds: int = 3, requests: int = 1500, seconds: float = 4.0, connections: int = 16,
        envoy_concurrency: int = 1, warmup: float = 0.5, protobuf_seconds: float = 1.5,
        keep: bool = False, log: Callable[[str], None] | None = None,
        response_processing: str = "usage_trailers") -> list[Row]:
    """Start the stack, measure, stop it; return the rows ``render_markdown`` turns into tables."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    rows = context_rows(envoy_concurrency)
    rows += [Row("context", "request", {"value": f"POST /v1/chat/completions, {len(BODY)}-byte JSON body with "
                                                  "max_tokens, HTTP/1.1 keep-alive, constant backend; "
                                                  f"response_processing: {response_processing}"}),
             Row("context", "method", {"value": f"{rounds} rounds, configs interleaved (a,b,c / b,c,a / ...); "
                                                 f"1 conn: {requests} sequential requests per config per round; "
                                                 f"{connections} conns: {seconds:g} s per config per round; "
                                                 f"{warmup:g} s warm-up before each; medians over rounds"})]
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    stack = Stack(workdir, envoy_concurrency, response_processing)
    ok = False
    try:
        say(f"starting backend, pass-through ext_proc, Sluice and 3 Envoys in {workdir}")
        stack.start()
        gc.freeze()  # the config renderer's objects need no more collecting
        say("warming up every configuration")
        for c in CONFIGS:
            warm = asyncio.run(_drive(stack.listen[c], connections, 1.0, count=200))
            if warm.errors or len(warm.latencies_ns) < 200:
                raise RuntimeError(f"{NAMES[c]}: warm-up failed ({warm.errors} non-200 responses)")
        one: dict[str, list[Sample]] = {c: [] for c in CONFIGS}
        many: dict[str, list[Sample]] = {c: [] for c in CONFIGS}
        cpu: dict[str, dict[str, int]] = {c: {} for c in CONFIGS}
        served: dict[str, int] = dict.fromkeys(CONFIGS, 0)
        phases: dict[str, Hist] = {"1 conn": {}, f"{connections} conns": {}}
        t_start, busy_start, ours_start = time.monotonic(), _machine_busy_ticks(), sum(stack.cpu_ticks().values())
        for r in range(rounds):
            order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
            for c in order:
                before_h = parse_phase_histogram(stack.sluice_metrics()) if c == "c" else {}
                s = asyncio.run(_drive(stack.listen[c], 1, warmup, count=requests))
                if c == "c":
                    _hist_add(phases["1 conn"], before_h, parse_phase_histogram(stack.sluice_metrics()))
                one[c].append(s)
                say(f"round {r + 1}/{rounds} {NAMES[c]:36} 1 conn   p50 {pct(s.latencies_ns, .5):.3f} ms"
                    f"  p99 {pct(s.latencies_ns, .99):.3f} ms")
            for c in order:
                procs = [f"envoy-{c}", "backend"] + (["passthrough"] if c == "b" else ["sluice"] if c == "c" else [])
                before_h = parse_phase_histogram(stack.sluice_metrics()) if c == "c" else {}
                before = stack.cpu_ticks(procs)
                s = asyncio.run(_drive(stack.listen[c], connections, warmup, seconds=seconds))
                after = stack.cpu_ticks(procs)
                if c == "c":
                    _hist_add(phases[f"{connections} conns"], before_h, parse_phase_histogram(stack.sluice_metrics()))
                for k in after:
                    cpu[c][k] = cpu[c].get(k, 0) + after[k] - before.get(k, after[k])
                served[c] += len(s.latencies_ns)
                many[c].append(s)
                say(f"round {r + 1}/{rounds} {NAMES[c]:36} {connections} conns {s.rps:8.0f} req/s"
                    f"  p50 {pct(s.latencies_ns, .5):.3f} ms")
        elapsed = time.monotonic() - t_start
        busy = _machine_busy_ticks() - busy_start
        ours = sum(stack.cpu_ticks().values()) - ours_start
        tick = os.sysconf("SC_CLK_TCK")
        others = max(0.0, (busy - ours) / tick / (elapsed * (os.cpu_count() or 1)))
        rows += _http_rows(one, many, connections, rounds)
        rows += _noise_rows(one, many, connections, others, elapsed)
        cpu_rows = [Row("cpu", NAMES[c], {k: v / tick / max(served[c], 1) * 1e6 for k, v in cpu[c].items()})
                    for c in CONFIGS]
        rows += cpu_rows
        pt_cpu, sluice_cpu = cpu_rows[1].values.get("passthrough"), cpu_rows[2].values.get("sluice")
        for r in rows:
            if r.table == "throughput" and "ratio_c_over_b" in r.values and pt_cpu and sluice_cpu:
                r.values["ratio_from_cpu"] = pt_cpu / sluice_cpu
        say("reading Sluice's phase histogram and Envoy's access logs")
        rows += phase_rows(phases)
        rows += access_log_rows(stack.logs)
        ok = True
    finally:
        stack.stop()
        if ok and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")
    say("protobuf: betterproto2 vs upb")
    rows += protobuf_rows(protobuf_seconds)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1500, help="sequential requests per config per round (1 conn)")
    ap.add_argument("--seconds", type=float, default=4.0, help="load per config per round at --connections")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--envoy-concurrency", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON")
    ap.add_argument("--keep", action="store_true", help="keep configs and logs (Envoy access logs) after the run")
    ap.add_argument("--response-processing", default="usage_trailers", choices=["usage_trailers", "streamed"],
                    help="the Envoy config's response path, for (b) and (c)")
    args = ap.parse_args(argv)
    rows = run(rounds=args.rounds, requests=args.requests, seconds=args.seconds, connections=args.connections,
               envoy_concurrency=args.envoy_concurrency, keep=args.keep, response_processing=args.response_processing)
    print(render_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
