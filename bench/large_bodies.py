"""Large bodies stay cheap for everyone else: small requests beside a client of 128 KiB prompts.

    python -m bench.large_bodies [--rounds 3] [--requests 600]

One Envoy (``--concurrency 1``) and one Sluice in front of ``bench.fastbackend``, with
``response_processing`` as given (default ``access_log``). Each round measures, in an
order rotated round to round:

    alone     small chat completions (``bench.overhead``'s ~200-byte body), one connection,
              one after the other
    english   the same, while one other client sends 128 KiB prompts of English prose
              (``bench.corpus``), one after the other, on its own connection
    spaces    the same with 128 Ki spaces (the seeds' junk prompt: one pre-tokenizer piece)

and reports the small requests' p50 and p99 (medians over rounds) and how much each
rises over ``alone`` measured in the same round. For the large requests it reports what
one costs under the one-round-trip request side: the body chunks Envoy sent (ext_proc
messages per request, from Envoy's counters), the requests completed, and Sluice's
handler time for the body (``sluice_extproc_phase_seconds``).

The large prompts go to a model whose window holds them (128 k tokens), so they are
counted whole and admitted, the worst case for their neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench import corpus
from bench.overhead import bench_policy, envoy_binary
from bench.overhead_load import KEY, MODEL, _connect, _drive, pct
from bench.overhead_report import parse_phase_histogram
from bench.procs import ProcGroup, free_port, http_ok
from bench.report import table

SIZE = 128 * 1024
LONG_MODEL = "bench-long"
KINDS = ("alone", "english", "spaces")


def prompt_body(kind: str) -> bytes:
    text = corpus.english() if kind == "english" else " "
    text = (text * (SIZE // len(text) + 1))[:SIZE]
    return json.dumps({"model": LONG_MODEL, "max_tokens": 16,
                       "messages": [{"role": "user", "content": text}]}).encode()


def large_request(kind: str) -> bytes:
    body = prompt_body(kind)
    head = (f"POST /v1/chat/completions?bench=large HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class Stack(ProcGroup):
    def __init__(self, workdir: Path, response_processing: str) -> None:
        super().__init__(workdir)
        self.rp = response_processing
        self.backend, self.grpc, self.admin, self.listen, self.envoy_admin = (free_port() for _ in range(5))

    def start(self) -> None:
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        envoy_binary()
        py = sys.executable
        self.start_fast_backend(self.backend)
        doc = bench_policy(self.backend)
        doc["gateway"]["response_processing"] = self.rp
        doc["backends"][0]["models"].append({"name": LONG_MODEL, "context_window": 131072,
                                             "encoding": "cl100k_base"})
        pol = self.dir / "policies"
        pol.mkdir()
        (pol / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        self.start_proc("sluice", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                   f"127.0.0.1:{self.grpc}", "--admin", f"127.0.0.1:{self.admin}"],
                        lambda: http_ok(f"http://127.0.0.1:{self.admin}/healthz"))
        opts = EnvoyOptions(listen_port=self.listen, admin_port=self.envoy_admin, extproc_port=self.grpc,
                            max_body_bytes=doc["gateway"]["max_body_bytes"], message_timeout_ms=5000,
                            response_processing=self.rp)
        cfg = render_bootstrap([BackendRoute("fast", "127.0.0.1", self.backend, (MODEL, LONG_MODEL))], opts)
        self.start_envoy("envoy", cfg, self.envoy_admin, 1)

    def envoy_sent(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.envoy_admin}/stats?format=json", timeout=5) as r:
            stats = json.loads(r.read())["stats"]
        return next(
            (float(s["value"]) for s in stats if s.get("name") == "http.sluice.ext_proc.sluice.stream_msgs_sent"), 0.0
        )

    def body_seconds(self) -> tuple[float, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5) as r:
            h = parse_phase_histogram(r.read().decode()).get("request_body", {})
        return h.get("sum", 0.0), h.get("count", 0.0)


async def _large_loop(port: int, data: bytes, stop: asyncio.Event, done: list[int]) -> None:
    c = await _connect(port)
    try:
        while not stop.is_set():
            status = await c.call(data)
            done.append(status)
    finally:
        if c.transport is not None:
            c.transport.close()


async def _measure(port: int, kind: str, requests: int) -> tuple[Any, list[int]]:
    done: list[int] = []
    stop = asyncio.Event()
    large = asyncio.ensure_future(_large_loop(port, large_request(kind), stop, done)) if kind != "alone" else None
    if large is not None:
        await asyncio.sleep(0.3)  # the large client is busy before the small ones start
    try:
        return await _drive(port, 1, 0.3, count=requests), done
    finally:
        stop.set()
        if large is not None:
            await large


def run(rounds: int, requests: int, response_processing: str, log: Any = print) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="sluice-large-"))
    stack = Stack(workdir, response_processing)
    p50: dict[str, list[float]] = {k: [] for k in KINDS}
    p99: dict[str, list[float]] = {k: [] for k in KINDS}
    rise: dict[str, list[float]] = {k: [] for k in KINDS}
    large_done: dict[str, int] = dict.fromkeys(KINDS, 0)
    try:
        stack.start()
        asyncio.run(_drive(stack.listen, 4, 1.0, count=200))
        for r in range(rounds):
            order = KINDS[r % 3:] + KINDS[:r % 3]
            got: dict[str, float] = {}
            for kind in order:
                s, done = asyncio.run(_measure(stack.listen, kind, requests))
                if s.errors or any(st != 200 for st in done):
                    raise RuntimeError(f"{kind}: {s.errors} small and {sum(st != 200 for st in done)} large failed")
                p50[kind].append(pct(s.latencies_ns, .5))
                got[kind] = pct(s.latencies_ns, .99)
                p99[kind].append(got[kind])
                large_done[kind] += len(done)
                log(f"round {r + 1}/{rounds} {kind:8} small p50 {p50[kind][-1]:.3f} p99 {got[kind]:.3f} ms, "
                    f"{len(done)} large")
            for kind in KINDS:
                rise[kind].append(got[kind] - got["alone"])
        # What one large request costs: measured alone, 20 of each kind.
        cost: dict[str, tuple[float, float]] = {}
        for kind in ("english", "spaces"):
            sent, (sec, count) = stack.envoy_sent(), stack.body_seconds()
            t0 = time.monotonic()
            asyncio.run(_drive_raw(stack.listen, large_request(kind), 20))
            took = (time.monotonic() - t0) / 20
            sent2, (sec2, count2) = stack.envoy_sent(), stack.body_seconds()
            cost[kind] = ((sent2 - sent) / 20, (sec2 - sec) / 20 * 1e3)
            log(f"{kind}: {cost[kind][0]:.1f} messages, {cost[kind][1]:.2f} ms of body handling, "
                f"{took * 1e3:.2f} ms end to end per request ({(count2 - count) / 20:.1f} body answers timed)")
    finally:
        stack.stop()
    med = statistics.median
    rows = [[kind, f"{med(p50[kind]):.3f}", f"{med(p99[kind]):.3f}",
             "" if kind == "alone" else f"{med(rise[kind]):+.3f}", str(large_done[kind])] for kind in KINDS]
    out = [f"Small requests beside one client of 128 KiB prompts (response_processing: {response_processing}; "
           f"{rounds} rounds of {requests} small requests per case; medians over rounds; the rise is over "
           "`alone` in the same round):", "",
           table(["beside", "small p50 ms", "small p99 ms", "p99 rise ms", "large requests served"], rows), "",
           "What one 128 KiB request costs (20 alone, each kind):", "",
           table(["prompt", "ext_proc messages sent by Envoy", "Sluice body handling ms"],
                 [[k, f"{v[0]:.1f}", f"{v[1]:.2f}"] for k, v in cost.items()]), ""]
    target = max(med(rise["english"]), med(rise["spaces"]))
    out += [f"Target: the small requests' p99 rises by ≤ 3 ms: +{target:.2f} ms at most, "
            f"{'met' if target <= 3 else '**missed**'}.", ""]
    return "\n".join(out)


async def _drive_raw(port: int, data: bytes, n: int) -> None:
    c = await _connect(port)
    try:
        for _ in range(n):
            status = await c.call(data)
            if status != 200:
                raise RuntimeError(f"large request answered {status}")
    finally:
        if c.transport is not None:
            c.transport.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.large_bodies", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--response-processing", default="access_log",
                    choices=["access_log", "usage_trailers", "streamed"])
    args = ap.parse_args(argv)
    print(run(args.rounds, args.requests, args.response_processing,
              lambda s: print(s, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
