"""What picker mode costs per SSE event, against Sluice's own data path and Envoy alone.

    python -m bench.picker_cost          # ~2 minutes; markdown on stdout, progress on stderr

16 concurrent streams of 200 and of 1,000 tokens (one SSE event per token, 20 ms apart, from
``bench.pacedbackend``; the client does not ask for usage), through five gateways side by
side, each its own Envoy (``--concurrency 1``) and, where there is one, its own Sluice:

    alone     Envoy alone: Sluice's bootstrap without the ext_proc filter
    trailers  Sluice's own Envoy and path (``usage_trailers``: Envoy reads the usage)
    picker    GIE's reference Envoy (tests/e2e/gateways/gie-envoy.yaml, addresses and ports
              changed) in front of Sluice ``--picker`` over TLS: both bodies FULL_DUPLEX_STREAMED,
              so every event is a message to Sluice and its echo back
    plain     the same without TLS between Envoy and Sluice (the config's transport socket
              removed, ``--picker-plaintext``): what the encryption costs
    grpcio    as picker, with the picker port on grpc.aio (``--picker-stack grpcio``) instead
              of Sluice's HTTP/2 server (extproc.wire.h2grpc): what the serving stack costs

CPU is each process's CPU time over the run minus its idle rate (``bench.response_cost``'s
method); TTFT is the client's time from sending the request to the first ``data:`` event,
and "added" is the median of the per-round differences to Envoy alone. Load from other
processes lands on the gateways alike, since they stream at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.procs import ProcGroup, free_port, http_ok, tcp_open
from bench.response_cost import KEY, MODEL, cpu_ns
from bench.response_cost import policy as own_policy

CONFIGS = {"alone": "Envoy alone (no ext_proc)", "trailers": "Sluice's own path (usage_trailers)",
           "picker": "picker mode under GIE's Envoy (FULL_DUPLEX, TLS)",
           "plain": "picker mode, GIE's Envoy without its TLS (--picker-plaintext)",
           "grpcio": "picker mode on grpc.aio (--picker-stack grpcio, TLS)"}
PICKERS = ("picker", "plain", "grpcio")
TARGET_US = 30.0


def picker_policy(port: int) -> dict[str, Any]:
    doc = own_policy(port)
    be = doc["backends"][0]
    be["endpoints"] = [{"address": be.pop("address"), "metrics_url": be.pop("metrics_url")}]
    return doc


def gie_config(listen: int, admin: int, ready: int, picker: int, tls: bool = True) -> dict[str, Any]:
    from tests.e2e import gateway_configs as gc

    cfg = gc.relocate(gc.vendored("gie"), gc.Ports(admin=admin, ready=ready, listener=listen, picker=picker))
    if not tls:
        for cl in cfg["static_resources"]["clusters"]:
            if cl["name"] == "ext_proc":
                cl.pop("transport_socket", None)
                for hc in cl.get("health_checks", []):
                    hc.pop("tls_options", None)
    for li in cfg["static_resources"]["listeners"]:  # a log line per request is the config's, not Sluice's
        li.pop("access_log", None)
        for fc in li["filter_chains"]:
            fc["filters"][0]["typed_config"].pop("access_log", None)
    return cfg


async def one(port: int, tokens: int, interval_ms: int) -> tuple[int, bool, bool, float]:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": tokens + 8,
                       "messages": [{"role": "user", "content": "count to a thousand"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nx-paced-events: {tokens}\r\n"
            f"x-paced-interval-ms: {interval_ms}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(head + body)
    data = bytearray()
    ttft = float("nan")
    while not data.endswith(b"0\r\n\r\n"):
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
        if ttft != ttft and b"data: {" in data:
            ttft = time.perf_counter() - t0
    writer.close()
    ok = data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data
    return data.count(b"data: {"), ok, b'"usage":{' in data, ttft


@dataclass
class Row:
    config: str
    tokens: int
    ok: int
    requests: int
    events: int
    envoy_ns: float
    extproc_ns: float
    ttft_s: float
    leaked: bool
    added_ttft_s: float = 0.0


class Bench(ProcGroup):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.backend = free_port()
        self.listen = {c: free_port() for c in CONFIGS}
        self.envoy_admin = {c: free_port() for c in CONFIGS}
        self.grpc = {c: free_port() for c in ("trailers", *PICKERS)}
        self.admin = {c: free_port() for c in ("trailers", *PICKERS)}
        self.picker = {c: free_port() for c in PICKERS}
        self.ready = {c: free_port() for c in PICKERS}

    def start(self) -> None:
        from bench.overhead import strip_ext_proc
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        py = sys.executable
        self.start_proc("backend", [py, "-m", "bench.pacedbackend", "--port", str(self.backend)],
                        lambda: tcp_open(self.backend))
        for c in ("trailers", *PICKERS):
            doc = own_policy(self.backend) if c == "trailers" else picker_policy(self.backend)
            pol = self.dir / f"policies-{c}"
            pol.mkdir()
            (pol / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
            extra = ["--picker", f"127.0.0.1:{self.picker[c]}", "--picker-health", "off", "--picker-metrics", "off",
                     *(["--picker-plaintext"] if c == "plain" else []),
                     *(["--picker-stack", "grpcio"] if c == "grpcio" else [])] if c in PICKERS else []
            admin = self.admin[c]
            self.start_proc(f"sluice-{c}", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                            f"127.0.0.1:{self.grpc[c]}", "--admin", f"127.0.0.1:{admin}",
                                            "--reload-interval", "60", *extra],
                            lambda admin=admin: http_ok(f"http://127.0.0.1:{admin}/healthz"))
        for c in ("alone", "trailers"):
            opts = EnvoyOptions(listen_port=self.listen[c], admin_port=self.envoy_admin[c],
                                extproc_port=self.grpc.get(c, 1), message_timeout_ms=5000, access_log=False,
                                response_processing="usage_trailers")
            cfg = render_bootstrap([BackendRoute("paced", "127.0.0.1", self.backend)], opts)
            self.start_envoy(f"envoy-{c}", strip_ext_proc(cfg) if c == "alone" else cfg, self.envoy_admin[c], 1)
        for c in PICKERS:
            cfg = gie_config(self.listen[c], self.envoy_admin[c], self.ready[c], self.picker[c], tls=c != "plain")
            self.start_envoy(f"envoy-{c}", cfg, self.envoy_admin[c], 1)

    def pids(self) -> dict[tuple[str, str], int]:
        out = {(c, "envoy"): self.procs[f"envoy-{c}"].pid for c in CONFIGS}
        out.update({(c, "extproc"): self.procs[f"sluice-{c}"].pid for c in ("trailers", *PICKERS)})
        return out

    def idle(self, seconds: float) -> dict[tuple[str, str], float]:
        pids = self.pids()
        t0, c0 = time.monotonic(), {k: cpu_ns(p) for k, p in pids.items()}
        time.sleep(seconds)
        return {k: (cpu_ns(p) - c0[k]) / (time.monotonic() - t0) for k, p in pids.items()}

    def round(self, streams: int, tokens: int, interval_ms: int, idle: dict[tuple[str, str], float]) -> list[Row]:
        pids = self.pids()
        t0, c0 = time.monotonic(), {k: cpu_ns(p) for k, p in pids.items()}

        async def go() -> list[list[tuple[int, bool, bool, float]]]:
            return await asyncio.gather(*(asyncio.gather(*(one(self.listen[c], tokens, interval_ms)
                                                           for _ in range(streams))) for c in CONFIGS))

        got = dict(zip(CONFIGS, asyncio.run(go()), strict=True))
        dt = time.monotonic() - t0
        used = {k: max(0.0, cpu_ns(p) - c0[k] - idle[k] * dt) for k, p in pids.items()}
        rows = []
        for c in CONFIGS:
            events = streams * (tokens + (0 if c == "alone" else 1))  # Sluice asks for the usage chunk
            rows.append(Row(c, tokens, sum(g[1] for g in got[c]), streams, events, used[(c, "envoy")],
                            used.get((c, "extproc"), 0.0), statistics.median(g[3] for g in got[c]),
                            any(g[2] for g in got[c])))
        return rows


def render(rows: list[Row], rounds: int, load: tuple[float, float]) -> str:
    out = [f"{rows[0].requests} concurrent streams per gateway, one SSE event per token, 20 ms apart; load average "
           f"at start {load[0]:.2f} / {load[1]:.2f} ({os.cpu_count()} cores); median of {rounds} rounds, the five "
           "gateways side by side in each", "",
           "| gateway | tokens | ok | Envoy µs/event | extproc µs/event | TTFT p50 ms | TTFT added ms | "
           "usage chunk hidden |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        alone = r.config == "alone"
        out.append(f"| {CONFIGS[r.config]} | {r.tokens} | {r.ok}/{r.requests} | {r.envoy_ns / r.events / 1000:.1f} | "
                   f"{'–' if alone else f'{r.extproc_ns / r.events / 1000:.1f}'} | {r.ttft_s * 1000:.2f} | "
                   f"{'–' if alone else f'{r.added_ttft_s * 1000:+.2f}'} | "
                   f"{'–' if alone else ('no' if r.leaked else 'yes')} |")
    picker = [r for r in rows if r.config in ("picker", "plain")]
    if picker:
        worst = max(r.extproc_ns / r.events / 1000 for r in picker)
        out += ["", f"picker mode: extproc {worst:.1f} µs/event at worst (target <= {TARGET_US:.0f})"]
    for tokens in sorted({r.tokens for r in rows}):
        by = {r.config: r for r in rows if r.tokens == tokens}
        if "picker" in by and "grpcio" in by and by["picker"].extproc_ns:
            out.append(f"{tokens} tokens: grpc.aio / h2grpc extproc CPU = "
                       f"{by['grpcio'].extproc_ns / by['picker'].extproc_ns:.2f}, Envoy CPU = "
                       f"{by['grpcio'].envoy_ns / max(by['picker'].envoy_ns, 1):.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.picker_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--interval-ms", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep configs and logs")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="sluice-picker-cost-"))
    b = Bench(workdir)
    rows: list[Row] = []
    try:
        print(f"starting the paced backend, 4 Sluices and 5 Envoys in {workdir}", file=sys.stderr, flush=True)
        b.start()
        for c in CONFIGS:  # warm every path once
            print(f"warming {c}", file=sys.stderr, flush=True)
            asyncio.run(asyncio.wait_for(one(b.listen[c], 5, 1), 30))
        idle = b.idle(args.idle_s)
        for tokens in args.tokens:
            per: dict[str, list[Row]] = {c: [] for c in CONFIGS}
            for i in range(args.rounds):
                for r in b.round(args.streams, tokens, args.interval_ms, idle):
                    per[r.config].append(r)
                    print(f"round {i + 1} {r.config:8} {tokens:5} tokens: envoy {r.envoy_ns / r.events / 1000:6.1f} "
                          f"µs/event, extproc {r.extproc_ns / r.events / 1000:6.1f} µs/event, ttft "
                          f"{r.ttft_s * 1000:.2f} ms, {r.ok}/{r.requests} ok", file=sys.stderr, flush=True)
            for c in CONFIGS:
                rs = per[c]
                m = Row(c, tokens, min(r.ok for r in rs), rs[0].requests, rs[0].events,
                        statistics.median(r.envoy_ns for r in rs), statistics.median(r.extproc_ns for r in rs),
                        statistics.median(r.ttft_s for r in rs), any(r.leaked for r in rs))
                m.added_ttft_s = statistics.median(r.ttft_s - a.ttft_s for r, a in zip(rs, per["alone"], strict=True))
                rows.append(m)
    finally:
        b.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(render(rows, args.rounds, (load[0], load[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
