"""How long an upload Sluice reads takes to reach it, at a distance: the stream window.

    python -m bench.upload_window [--delay-ms 1] [--requests 30] [--baseline-tree DIR]

Envoy streams a request's body to Sluice without waiting for the headers' answer, so
Sluice's HTTP/2 server (``extproc.wire.h2grpc``) gives each stream a small first window
(a request refused from its headers sends little of its upload) and opens it to the body
it expects once the headers pass (``Stream.widen``). Without that, a body larger than the
window comes half a window per round trip between Envoy and Sluice: nothing on loopback,
a round trip per 64 KiB between nodes.

One Envoy and one Sluice (``bench.fastbackend`` behind), and between Envoy and Sluice
either nothing or ``bench.delay_proxy`` holding each chunk ``--delay-ms`` each way. Each
size is sent ``--requests`` times, one after the other, after 5 unmeasured: a body of junk
that Sluice reads whole and refuses as bad JSON (a 400), so what is timed is the upload
reaching Sluice and its answer, not tokenizing. With ``--baseline-tree`` the same runs
with that checkout's Sluice (e.g. ``git worktree add /tmp/before main``) beside this one's.
Prints p50 per size, and the 1 KiB row is the round trip itself.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.overhead import bench_policy, envoy_binary
from bench.overhead_load import KEY, _connect
from bench.procs import ROOT, ProcGroup, free_port, http_ok, tcp_open
from bench.report import table

SIZES = (1 << 10, 128 << 10, 1 << 20)
MAX_BODY = 4 << 20


def junk_request(size: int) -> bytes:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {size}\r\n\r\n")
    return head.encode() + b"x" * size


class Stack(ProcGroup):
    """Per tree a Sluice; per (tree, delay) an Envoy, through a proxy when delayed."""

    def __init__(self, workdir: Path, trees: dict[str, Path], delays: tuple[float, ...]) -> None:
        super().__init__(workdir)
        self.trees, self.delays = trees, delays
        self.backend = free_port()
        self.grpc = {name: free_port() for name in trees}
        self.listen = {(name, d): free_port() for name in trees for d in delays}

    def start(self) -> None:
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        envoy_binary()
        py = sys.executable
        self.start_fast_backend(self.backend)
        doc = bench_policy(self.backend)
        doc["gateway"].update(response_processing="access_log", max_body_bytes=MAX_BODY)
        pol = self.dir / "policies"
        pol.mkdir()
        (pol / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        for name, tree in self.trees.items():
            admin = free_port()
            self.start_proc(f"sluice-{name}", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                               f"127.0.0.1:{self.grpc[name]}", "--admin", f"127.0.0.1:{admin}"],
                            lambda admin=admin: http_ok(f"http://127.0.0.1:{admin}/healthz"), cwd=tree)
            for d in self.delays:
                extproc = self.grpc[name]
                if d:
                    extproc = free_port()
                    self.start_proc(f"proxy-{name}-{d}", [py, "-m", "bench.delay_proxy", str(extproc),
                                                          str(self.grpc[name]), str(d)],
                                    lambda port=extproc: tcp_open(port))
                envoy_admin = free_port()
                opts = EnvoyOptions(listen_port=self.listen[name, d], admin_port=envoy_admin, extproc_port=extproc,
                                    max_body_bytes=MAX_BODY, message_timeout_ms=5000,
                                    response_processing="access_log")
                cfg = render_bootstrap([BackendRoute("fast", "127.0.0.1", self.backend)], opts)
                self.start_envoy(f"envoy-{name}-{d}", cfg, envoy_admin, 1)


async def _series(port: int, data: bytes, n: int) -> list[float]:
    out = []
    for i in range(n + 5):
        c = await _connect(port)  # Envoy closes a connection after a local reply
        try:
            t0 = time.perf_counter()
            status = await c.call(data)
            took = (time.perf_counter() - t0) * 1e3
        finally:
            if c.transport is not None:
                c.transport.close()
        if status != 400:
            raise RuntimeError(f"junk upload answered {status}, not 400")
        if i >= 5:
            out.append(took)
    return out


def run(delay_ms: float, requests: int, baseline: Path | None, log: Any = print) -> str:
    trees = {"this checkout": ROOT, **({"baseline": baseline} if baseline is not None else {})}
    delays = (0.0, delay_ms)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-upload-window-"))
    stack = Stack(workdir, trees, delays)
    p50: dict[tuple[str, float, int], float] = {}
    try:
        stack.start()
        for size in SIZES:
            for d in delays:
                for name in trees:
                    lat = asyncio.run(_series(stack.listen[name, d], junk_request(size), requests))
                    p50[name, d, size] = statistics.median(lat)
                    log(f"{name:14} delay {d:g} ms {size:>8} B  p50 {p50[name, d, size]:.2f} ms")
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    head = ["body", *(f"{name}, {'loopback' if not d else f'+{d:g} ms each way'}" for d in delays for name in trees)]
    rows = [[f"{size >> 10} KiB", *(f"{p50[name, d, size]:.2f}" for d in delays for name in trees)] for size in SIZES]
    return "\n".join([f"Uploads Sluice reads whole (junk, refused as bad JSON after it), {requests} per cell one "
                      "after the other, p50 ms from the client (each on its own connection: Envoy closes it "
                      "after a local reply):", "", table(head, rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.upload_window", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--baseline-tree", type=Path, help="a checkout whose Sluice to run beside this one's")
    args = ap.parse_args(argv)
    print(run(args.delay_ms, args.requests, args.baseline_tree, lambda s: print(s, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
