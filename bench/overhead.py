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
    (d) with ``--host``: the whole host, Envoy with 2 workers in front of Sluice
        ``serve --workers 2`` (one gRPC port each, both in Envoy's ext_proc cluster) on a
        Redis store (Debian's ``redis-server``), the deployment that uses both cores;
        ``--host-envoy-workers`` and ``--host-workers`` change the two counts
    (f) with ``--grpcio``: Sluice as (c) with ``--grpc-stack grpcio``, its port served by
        grpc.aio instead of ``extproc.wire.h2grpc``: the serving stack's share, same run
    (e) with ``--baseline-tree DIR``: Sluice run from another checkout (``git worktree add
        DIR main``) with the Envoy config that checkout renders, in its default
        ``response_processing``: a before/after measured in the same run

One Envoy worker each for (a) to (c): the machine has 2 cores shared by the load generator, the backend,
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
from typing import Any, NamedTuple

import yaml

from bench.overhead_load import BODY, KEY, MODEL, Sample, _drive, pct
from bench.overhead_report import (
    BASELINE,
    CONFIGS,
    GRPCIO,
    HOST,
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
from bench.procs import ProcGroup, free_port, free_ports, http_ok, tcp_open, wait_until
from bench.procs import envoy_binary as _envoy_binary
from bench.protobench import protobuf_rows

__all__ = ["Row", "main", "render_markdown", "run"]


# -- processes ---------------------------------------------------------------------------
class HostShape(NamedTuple):
    """(d)'s processes: Envoy's workers, and Sluice's (``serve --workers``, on the Redis store)."""
    envoy_workers: int = 2
    sluice_workers: int = 2

    def __str__(self) -> str:
        return f"Envoy x{self.envoy_workers}, Sluice --workers {self.sluice_workers}"


DEFAULT_SHAPE = HostShape()


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
    """Backend, pass-through ext_proc, Sluice and three Envoys, all on random ports; with
    ``host``, also Redis, Sluice's workers and a fourth Envoy (config (d))."""

    def __init__(self, workdir: Path, envoy_concurrency: int, response_processing: str = "usage_trailers",
                 host: bool = False, baseline: Path | None = None, grpcio: bool = False,
                 host_shape: HostShape = DEFAULT_SHAPE) -> None:
        super().__init__(workdir)
        self.shape = host_shape
        self.concurrency = envoy_concurrency
        self.response_processing = response_processing
        self.baseline = baseline
        self.configs = (*CONFIGS, *((GRPCIO,) if grpcio else ()), *((HOST,) if host else ()),
                        *((BASELINE,) if baseline else ()))
        self.grpcio_grpc, self.grpcio_admin = free_port(), free_port()
        self.base_grpc, self.base_admin = free_port(), free_port()
        self.backend_port, self.pt_port, self.grpc_port, self.admin_port = (free_port() for _ in range(4))
        n = host_shape.sluice_workers
        self.workers_grpc, self.workers_admin = (free_ports(n), free_ports(n)) if host else (0, 0)
        self.listen = {c: free_port() for c in self.configs}
        self.envoy_admin = {c: free_port() for c in self.configs}
        self.redis: Any = None

    def start(self) -> None:
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        envoy_binary()  # without Envoy, stop the whole run here (SystemExit), not mid-stack
        py = sys.executable
        self.start_fast_backend(self.backend_port)
        self.start_proc("passthrough", [py, "-m", "bench.passthrough_extproc", "--grpc", f"127.0.0.1:{self.pt_port}"],
                        lambda: tcp_open(self.pt_port), "pass-through ext_proc")
        doc = bench_policy(self.backend_port)
        doc["gateway"]["response_processing"] = self.response_processing  # as Envoy's config says
        self.start_proc("sluice", [py, "-m", "extproc", "serve", "--policy", str(self._policy_dir("policies", doc)),
                                   "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}"],
                        lambda: http_ok(f"http://127.0.0.1:{self.admin_port}/healthz"))
        if GRPCIO in self.configs:
            self.start_proc("sluice-grpcio", [py, "-m", "extproc", "serve", "--grpc-stack", "grpcio",
                                              "--policy", str(self._policy_dir("policies-grpcio", doc)),
                                              "--grpc", f"127.0.0.1:{self.grpcio_grpc}",
                                              "--admin", f"127.0.0.1:{self.grpcio_admin}"],
                            lambda: http_ok(f"http://127.0.0.1:{self.grpcio_admin}/healthz"))
        if HOST in self.configs:
            self._start_workers(doc)
        gw = doc["gateway"]
        for c in self.configs:
            if c == BASELINE:
                self._start_baseline(doc)
                continue
            extproc = {"c": self.grpc_port, HOST: self.workers_grpc, GRPCIO: self.grpcio_grpc}.get(c, self.pt_port)
            opts = EnvoyOptions(listen_port=self.listen[c], admin_port=self.envoy_admin[c], extproc_port=extproc,
                                extproc_more=tuple(("127.0.0.1", extproc + i)
                                                   for i in range(1, self.shape.sluice_workers if c == HOST else 1)),
                                max_body_bytes=gw["max_body_bytes"], message_timeout_ms=gw["message_timeout_ms"],
                                # (a) has no ext_proc, so no usage filters either: the streamed shape
                                response_processing="streamed" if c == "a" else self.response_processing)
            cfg = render_bootstrap([BackendRoute("fast", "127.0.0.1", self.backend_port, (MODEL,))], opts)
            if c == "a":
                cfg = strip_ext_proc(cfg)
            self.start_envoy(f"envoy-{c}", cfg, self.envoy_admin[c],
                             self.shape.envoy_workers if c == HOST else self.concurrency)

    def _policy_dir(self, name: str, doc: dict[str, Any]) -> Path:
        policy = self.dir / name
        policy.mkdir()
        (policy / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        return policy

    def _start_workers(self, doc: dict[str, Any]) -> None:
        from bench.redis_server import RedisServer

        self.redis = RedisServer(self.dir / "redis").start()
        doc = {**doc, "gateway": {**doc["gateway"], "state": self.redis.url}}
        n = self.shape.sluice_workers
        self.start_proc("sluice-workers", [sys.executable, "-m", "extproc", "serve", "--workers", str(n),
                                           "--policy", str(self._policy_dir("policies-workers", doc)),
                                           "--grpc", f"127.0.0.1:{self.workers_grpc}",
                                           "--admin", f"127.0.0.1:{self.workers_admin}"],
                        lambda: all(http_ok(f"http://127.0.0.1:{self.workers_admin + i}/healthz") for i in range(n)))

    def _start_baseline(self, doc: dict[str, Any]) -> None:
        """(e): the baseline checkout's Sluice, and the Envoy config it renders, in its default mode."""
        assert self.baseline is not None
        doc = {**doc, "gateway": {k: v for k, v in doc["gateway"].items() if k != "response_processing"}}
        pol = self._policy_dir("policies-baseline", doc)
        self.start_proc("sluice-baseline", [sys.executable, "-m", "extproc", "serve", "--policy", str(pol),
                                            "--grpc", f"127.0.0.1:{self.base_grpc}",
                                            "--admin", f"127.0.0.1:{self.base_admin}"],
                        lambda: http_ok(f"http://127.0.0.1:{self.base_admin}/healthz"), "baseline Sluice",
                        cwd=self.baseline)
        cfg = self.dir / "envoy-e.yaml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "extproc",
                "envoy-config",
                str(pol),
                "-o",
                str(cfg),
                "--listen",
                f"127.0.0.1:{self.listen[BASELINE]}",
                "--admin-port",
                str(self.envoy_admin[BASELINE]),
                "--extproc",
                f"127.0.0.1:{self.base_grpc}",
                "--extproc-admin",
                f"127.0.0.1:{self.base_admin}",
            ],
            cwd=self.baseline,
            check=True,
            capture_output=True,
        )
        self.start_envoy(f"envoy-{BASELINE}", yaml.safe_load(cfg.read_text()), self.envoy_admin[BASELINE],
                         self.concurrency)

    def stop(self) -> None:
        super().stop()
        if self.redis is not None:
            self.redis.stop()

    def _pids(self, name: str) -> list[int]:
        """A child's pid, and its children's (``serve --workers``: the supervisor's workers)."""
        if name == "redis":
            return [self.redis.proc.pid] if self.redis is not None and self.redis.proc is not None else []
        root = self.procs[name].popen
        assert root is not None
        pids, i = [root.pid], 0
        while i < len(pids):
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pids[i]}/task").iterdir():
                    pids += [int(p) for p in (task / "children").read_text().split()]
            i += 1
        return pids

    def cpu_ticks(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """utime+stime (clock ticks) of each named child (with its children), and of this
        process as "loadgen"."""
        out = {}
        for name in names if names is not None else [*self.procs, *(["redis"] if self.redis else [])]:
            total = 0
            for pid in self._pids(name):
                with contextlib.suppress(OSError):
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
            out[name] = total
        t = os.times()
        out["loadgen"] = round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))
        return out

    def ext_proc_counters(self, c: str) -> dict[str, float]:
        """Envoy ``c``'s ext_proc and gRPC access-log counters."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.envoy_admin[c]}/stats?format=json", timeout=5) as r:
            stats = json.loads(r.read())["stats"]
        names = {"http.sluice.ext_proc.sluice.stream_msgs_sent": "sent",
                 "http.sluice.ext_proc.sluice.stream_msgs_received": "received",
                 "http.sluice.ext_proc.sluice.streams_started": "streams",
                 "access_logs.grpc_access_log.logs_written": "logged"}
        out = dict.fromkeys(names.values(), 0.0)
        for st in stats:
            if st.get("name") in names:
                out[names[st["name"]]] += float(st.get("value", 0))
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
    return [
        Row("context", k, {"value": v})
        for k, v in [
            ("cores", f"{os.cpu_count()} ({cpu})"),
            ("python", f"{platform.python_implementation()} {platform.python_version()}"),
            (
                "envoy",
                f"{m.group(1) if m else version.strip()} (--concurrency {envoy_concurrency}, one instance per config)",
            ),
            ("grpcio / protobuf", f"{grpc.__version__} / {protobuf_version} ({api_implementation.Type()})"),
            ("load average at start", " ".join(f"{x:.2f}" for x in load)),
        ]
    ]


# -- the run ----------------------------------------------------------------------------------
# What a request waits for on the ext_proc streams: the request side is one round trip in
# every mode (headers answered with the body); usage_trailers adds the response headers
# and the trailers; streamed adds every response chunk (2 here: the body and its end).
BLOCKING = {"access_log": 1, "usage_trailers": 3, "streamed": 3}


def _served_by(c: str) -> list[str]:
    """The processes config ``c``'s requests cost CPU in, besides this load generator."""
    return [f"envoy-{c}", "backend", *{"b": ["passthrough"], "c": ["sluice"], HOST: ["sluice-workers", "redis"],
                                       BASELINE: ["sluice-baseline"], GRPCIO: ["sluice-grpcio"]}.get(c, [])]


def run(*, rounds: int = 3, requests: int = 1500, seconds: float = 4.0, connections: int = 16,
        envoy_concurrency: int = 1, warmup: float = 0.5, protobuf_seconds: float = 1.5,
        keep: bool = False, log: Callable[[str], None] | None = None,
        response_processing: str = "usage_trailers", host: bool = False,
        baseline: Path | None = None, grpcio: bool = False, host_shape: HostShape = DEFAULT_SHAPE) -> list[Row]:
    """Start the stack, measure, stop it; return the rows ``render_markdown`` turns into tables."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    rows = context_rows(envoy_concurrency)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    stack = Stack(workdir, envoy_concurrency, response_processing, host, baseline, grpcio, host_shape)
    configs = stack.configs
    rows += [Row("context", "request", {"value": f"POST /v1/chat/completions, {len(BODY)}-byte JSON body with "
                                                  "max_tokens, HTTP/1.1 keep-alive, constant backend; "
                                                  f"response_processing: {response_processing}"}),
             Row("context", "method", {"value": f"{rounds} rounds, configs interleaved ({','.join(configs)} / "
                                                 "rotated each round); "
                                                 f"1 conn: {requests} sequential requests per config per round; "
                                                 f"{connections} conns: {seconds:g} s per config per round; "
                                                 f"{warmup:g} s warm-up before each; medians over rounds"
                                                 + (f"; (d): {host_shape}" if host else "")})]
    ok = False
    try:
        say(f"starting backend, pass-through ext_proc, Sluice and {len(configs)} Envoys in {workdir}")
        stack.start()
        gc.freeze()  # the config renderer's objects need no more collecting
        say("warming up every configuration")
        for c in configs:
            if c == HOST:
                # A fresh Redis store: the workers admit once their first leases are in.
                wait_until(lambda: asyncio.run(_drive(stack.listen[HOST], 1, 0.0, count=20)).errors == 0,
                           "(d) admitting", timeout=30)
            warm = asyncio.run(_drive(stack.listen[c], connections, 1.0, count=200))
            if c == HOST and warm.errors:
                # Seen when Redis answers late (over 8 ms on a loaded box): a worker then
                # admits within its local share, and its first requests may be refused.
                say(f"{NAMES[c]}: {warm.errors} of the warm-up's requests refused (counted in the tables too)")
            elif warm.errors or len(warm.latencies_ns) < 200:
                raise RuntimeError(f"{NAMES[c]}: warm-up failed ({warm.errors} non-200 responses)")
        one: dict[str, list[Sample]] = {c: [] for c in configs}
        many: dict[str, list[Sample]] = {c: [] for c in configs}
        cpu: dict[str, dict[str, int]] = {c: {} for c in configs}
        msgs: dict[str, dict[str, float]] = {c: {} for c in configs}
        served: dict[str, int] = dict.fromkeys(configs, 0)
        phases: dict[str, Hist] = {"1 conn": {}, f"{connections} conns": {}}
        windows: dict[str, list[tuple[float, float]]] = {}  # wall-clock spans of the 1-connection runs
        t_start, busy_start, ours_start = time.monotonic(), _machine_busy_ticks(), sum(stack.cpu_ticks().values())
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for c in order:
                before_h = parse_phase_histogram(stack.sluice_metrics()) if c == "c" else {}
                w0 = time.time() + warmup
                s = asyncio.run(_drive(stack.listen[c], 1, warmup, count=requests))
                windows.setdefault(c, []).append((w0, time.time()))
                if c == "c":
                    _hist_add(phases["1 conn"], before_h, parse_phase_histogram(stack.sluice_metrics()))
                one[c].append(s)
                say(f"round {r + 1}/{rounds} {NAMES[c]:42} 1 conn   p50 {pct(s.latencies_ns, .5):.3f} ms"
                    f"  p99 {pct(s.latencies_ns, .99):.3f} ms")
            for c in order:
                procs = _served_by(c)
                before_h = parse_phase_histogram(stack.sluice_metrics()) if c == "c" else {}
                before, counters = stack.cpu_ticks(procs), stack.ext_proc_counters(c)
                s = asyncio.run(_drive(stack.listen[c], connections, warmup, seconds=seconds))
                after = stack.cpu_ticks(procs)
                for k, v in stack.ext_proc_counters(c).items():
                    msgs[c][k] = msgs[c].get(k, 0.0) + v - counters[k]
                if c == "c":
                    _hist_add(phases[f"{connections} conns"], before_h, parse_phase_histogram(stack.sluice_metrics()))
                for k in after:
                    cpu[c][k] = cpu[c].get(k, 0) + after[k] - before.get(k, after[k])
                # the warm-up's requests count in the counters too
                served[c] += len(s.latencies_ns) + s.warmup_requests
                many[c].append(s)
                say(f"round {r + 1}/{rounds} {NAMES[c]:42} {connections} conns {s.rps:8.0f} req/s"
                    f"  p50 {pct(s.latencies_ns, .5):.3f} ms")
        elapsed = time.monotonic() - t_start
        busy = _machine_busy_ticks() - busy_start
        ours = sum(stack.cpu_ticks().values()) - ours_start
        tick = os.sysconf("SC_CLK_TCK")
        others = max(0.0, (busy - ours) / tick / (elapsed * (os.cpu_count() or 1)))
        rows += _http_rows(one, many, connections, rounds)
        rows += _noise_rows(one, many, connections, others, elapsed)
        cpu_rows = [Row("cpu", NAMES[c], {k: v / tick / max(served[c], 1) * 1e6 for k, v in cpu[c].items()})
                    for c in configs]
        rows += cpu_rows
        rows += [Row("messages", NAMES[c], {**{k: v / max(served[c], 1) for k, v in msgs[c].items()},
                                            # the baseline: 4 (headers, body, response headers, trailers)
                                            "blocking": 4 if c == BASELINE else BLOCKING[response_processing]})
                 for c in configs if c != "a"]
        pt_cpu, sluice_cpu = cpu_rows[1].values.get("passthrough"), cpu_rows[2].values.get("sluice")
        for r in rows:
            if r.table == "throughput" and "ratio_c_over_b" in r.values and pt_cpu and sluice_cpu:
                r.values["ratio_from_cpu"] = pt_cpu / sluice_cpu
        say("reading Sluice's phase histogram and Envoy's access logs")
        rows += phase_rows(phases)
        rows += access_log_rows(stack.logs, windows)
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
    ap.add_argument("--response-processing", default="usage_trailers", choices=list(BLOCKING),
                    help="the Envoy config's response path, for (b) and (c)")
    ap.add_argument("--host", action="store_true",
                    help="also (d): Envoy with 2 workers, Sluice serve --workers 2 on a Redis store")
    ap.add_argument("--host-envoy-workers", type=int, default=2, help="(d)'s Envoy --concurrency")
    ap.add_argument("--host-workers", type=int, default=2, help="(d)'s Sluice serve --workers")
    ap.add_argument("--grpcio", action="store_true",
                    help="also (f): Sluice with its port served by grpc.aio (--grpc-stack grpcio)")
    ap.add_argument("--baseline-tree", type=Path, help="also (e): Sluice from this checkout, as it renders Envoy")
    args = ap.parse_args(argv)
    rows = run(rounds=args.rounds, requests=args.requests, seconds=args.seconds, connections=args.connections,
               envoy_concurrency=args.envoy_concurrency, keep=args.keep, response_processing=args.response_processing,
               host=args.host, baseline=args.baseline_tree, grpcio=args.grpcio,
               host_shape=HostShape(args.host_envoy_workers, args.host_workers))
    print(render_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
