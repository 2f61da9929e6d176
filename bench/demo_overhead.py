"""What ``make demo`` adds over its engine called directly, with the example policy.

    python -m bench.demo_overhead [--rounds 3] [--requests 400] [--baseline-tree DIR]

The demo's three simulated engines (``bench.demo.ENGINES``: the ``sim-llama-8b`` pool of
two with prefix caching, and the ``sim-llama-1b`` fallback), each on a random port, and in
front of them one Envoy and one Sluice per variant, all with the example policy
(``policies/``; only the engines' addresses rewritten, and the premium tier's TPM and RPM
lifted, since the bench sends hundreds of requests a second):

    access_log      this checkout, ``response_processing: access_log``
    usage_trailers  this checkout, ``response_processing: usage_trailers``
    baseline        with ``--baseline-tree``: Sluice and its rendered Envoy config from that
                    checkout (e.g. ``git worktree add /tmp/before main``), its default mode

and, to tell Envoy's part from Sluice's, ``envoy``: the ``access_log`` variant's Envoy
config with the ext_proc filter taken out (``bench.overhead.strip_ext_proc``), every other
filter and the access logs kept; without Sluice to place it, the pool's cluster takes its
fallback, round robin over the two engines.

Rounds interleave: direct to each of the pool's two engines, then each variant, the same
small non-streaming chat completion (``sk-demo-premium``, one output token) one after the
other on one keep-alive connection. The table shows medians over rounds of p50 and p99, and
what each variant adds over the engines called directly in the same round: over the engine
that served the variant's requests (each engine's ``vllm:request_success_total`` counted
around the series; prefix affinity sends the same prompt to the same one), weighted by
share if both did. Then Sluice's handler time per ext_proc message and phase
(``sluice_extproc_phase_seconds``) over the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.demo import ENGINES
from bench.overhead import envoy_binary, strip_ext_proc
from bench.overhead_load import _connect, pct
from bench.overhead_report import parse_phase_histogram
from bench.procs import ROOT, ProcGroup, free_port, http_ok
from bench.report import table
from bench.settle_lag import sample

KEY = "sk-demo-premium"
PLAIN = "envoy"  # the access_log variant's Envoy without its ext_proc filter
POOL = (8000, 8002)  # the sim-llama-8b pool's engines (bench.demo.ENGINES), which the request is for
TARGET_ADDED_P50_MS = 1.2
BODY = json.dumps({"model": "sim-llama-8b", "max_tokens": 1,
                   "messages": [{"role": "user", "content": "Say hello to the benchmark."}]}).encode()


def request_bytes() -> bytes:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\nx-sim-tokens: 1\r\ncontent-length: {len(BODY)}\r\n\r\n")
    return head.encode() + BODY


def example_policy(dest: Path, ports: dict[int, int], response_processing: str | None) -> Path:
    """policies/ with each demo engine port replaced, the premium tier's budgets lifted and,
    if given, response_processing set."""
    dest.mkdir(parents=True)
    for f in sorted((ROOT / "policies").glob("*.yaml")):
        text = f.read_text()
        for old, new in ports.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        doc = yaml.safe_load(text)
        if isinstance(doc, dict) and "tiers" in doc:
            doc["tiers"]["premium"].update(tpm=10**10, rpm=10**9)
        if isinstance(doc, dict) and "gateway" in doc and response_processing is not None:
            doc["gateway"]["response_processing"] = response_processing
        (dest / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


class Stack(ProcGroup):
    def __init__(self, workdir: Path, baseline: Path | None) -> None:
        super().__init__(workdir)
        self.engines = {port: free_port() for port in ENGINES}
        self.variants: dict[str, tuple[Path, str | None]] = {"access_log": (ROOT, "access_log"),
                                                             "usage_trailers": (ROOT, "usage_trailers")}
        if baseline is not None:
            self.variants["baseline"] = (baseline, None)
        self.ports = {v: {k: free_port() for k in ("grpc", "admin", "listen", "envoy_admin")} for v in self.variants}
        self.plain = {k: free_port() for k in ("listen", "envoy_admin")}

    def start(self) -> None:
        envoy_binary()
        py = sys.executable
        for demo_port, port in self.engines.items():
            self.start_proc(f"engine-{demo_port}", [py, "-m", "bench.simbackend", "--port", str(port),
                                                    *ENGINES[demo_port]],
                            lambda port=port: http_ok(f"http://127.0.0.1:{port}/health"))
        for v, (tree, mode) in self.variants.items():
            p = self.ports[v]
            pol = example_policy(self.dir / f"policies-{v}", self.engines, mode)
            eds = self.dir / f"eds-{v}"
            self.start_proc(f"sluice-{v}", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                            f"127.0.0.1:{p['grpc']}", "--admin", f"127.0.0.1:{p['admin']}",
                                            "--eds-dir", str(eds), "--log-level", "WARNING"],
                            lambda p=p: http_ok(f"http://127.0.0.1:{p['admin']}/healthz"), cwd=tree)
            cfg = self.dir / f"envoy-{v}.yaml"
            # The checkout's own renderer: a baseline gets the Envoy config it was written for.
            subprocess.run([py, "-m", "extproc", "envoy-config", str(pol), "-o", str(cfg),
                            "--listen", f"127.0.0.1:{p['listen']}", "--admin-port", str(p["envoy_admin"]),
                            "--extproc", f"127.0.0.1:{p['grpc']}", "--extproc-admin", f"127.0.0.1:{p['admin']}",
                            "--eds-dir", str(eds), "--no-eds-files"], cwd=tree, check=True, capture_output=True)
            self.start_proc(f"envoy-{v}", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                                           "--concurrency", "1"],
                            lambda p=p: http_ok(f"http://127.0.0.1:{p['envoy_admin']}/ready"))
        plain = strip_ext_proc(yaml.safe_load((self.dir / "envoy-access_log.yaml").read_text()))
        plain["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = self.plain["listen"]
        plain["admin"]["address"]["socket_address"]["port_value"] = self.plain["envoy_admin"]
        self.start_envoy("envoy-plain", plain, self.plain["envoy_admin"], 1)

    def served(self) -> dict[int, float]:
        """Requests each pool engine has finished (its own counter), by demo port."""
        out = {}
        for demo_port in POOL:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.engines[demo_port]}/metrics", timeout=5) as r:
                out[demo_port] = sample(r.read().decode(), "vllm:request_success_total")
        return out

    def phases(self, v: str) -> dict[str, dict[str, float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[v]['admin']}/metrics", timeout=5) as r:
            return parse_phase_histogram(r.read().decode())


async def _series(port: int, n: int) -> list[int]:
    import time

    c = await _connect(port)
    data = request_bytes()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            status = await c.call(data)
            if status != 200:
                raise RuntimeError(f"port {port} answered {status}")
            out.append(time.perf_counter_ns() - t0)
    finally:
        if c.transport is not None:
            c.transport.close()
    return out


def run(rounds: int, requests: int, baseline: Path | None, log: Any = print) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="sluice-demo-overhead-"))
    stack = Stack(workdir, baseline)
    direct = {f"engine {i + 1}": stack.engines[p] for i, p in enumerate(POOL)}
    gateways = {PLAIN: stack.plain["listen"], **{v: stack.ports[v]["listen"] for v in stack.variants}}
    names = [*direct, *gateways]
    p50: dict[str, list[float]] = {n: [] for n in names}
    p99: dict[str, list[float]] = {n: [] for n in names}
    added50: dict[str, list[float]] = {n: [] for n in gateways}
    added99: dict[str, list[float]] = {n: [] for n in gateways}
    shares: dict[str, list[list[float]]] = {n: [] for n in gateways}
    phase_delta: dict[str, dict[str, list[float]]] = {v: {} for v in stack.variants}
    try:
        stack.start()
        for port in gateways.values():  # warm: connections, tokenizer, placement
            asyncio.run(_series(port, 100))
        for port in direct.values():
            asyncio.run(_series(port, 100))
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            got50, got99, share = {}, {}, {}
            for n in order:
                before = stack.phases(n) if n in stack.variants else {}
                served = stack.served()
                lat = asyncio.run(_series(direct[n] if n in direct else gateways[n], requests))
                if n in gateways:
                    # the engines' own counts: the direct calls ran before or after, never meanwhile
                    now = stack.served()
                    done = [now[p] - served[p] for p in POOL]
                    share[n] = [d / max(1.0, sum(done)) for d in done]
                after = stack.phases(n) if n in stack.variants else {}
                for phase, vals in after.items():
                    cnt = vals.get("count", 0) - before.get(phase, {}).get("count", 0)
                    if cnt:
                        total = vals.get("sum", 0) - before.get(phase, {}).get("sum", 0)
                        phase_delta[n].setdefault(phase, []).append(total / requests * 1e6)
                got50[n], got99[n] = pct(lat, .5), pct(lat, .99)
                p50[n].append(got50[n])
                p99[n].append(got99[n])
                log(f"round {r + 1}/{rounds} {n:15} p50 {got50[n]:.3f} ms p99 {got99[n]:.3f} ms")
            for v in gateways:
                shares[v].append(share[v])
                added50[v].append(got50[v] - sum(w * got50[e] for w, e in zip(share[v], direct, strict=True)))
                added99[v].append(got99[v] - sum(w * got99[e] for w, e in zip(share[v], direct, strict=True)))
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    med = statistics.median
    rows = [[f"{e} directly", f"{med(p50[e]):.3f}", f"{med(p99[e]):.3f}", "", ""] for e in direct]
    rows += [[v, f"{med(p50[v]):.3f}", f"{med(p99[v]):.3f}", f"{med(added50[v]):+.3f} / {med(added99[v]):+.3f}",
              " / ".join(f"{statistics.mean(s[i] for s in shares[v]):.0%}" for i in range(len(POOL)))]
             for v in gateways]
    out = [f"`make demo`'s stack with the example policy: {rounds} rounds of {requests} sequential small "
           "non-streaming chat completions per path (one output token), medians over rounds:", "",
           table(["path", "p50 ms", "p99 ms", "added over the engine that served it, p50 / p99 ms",
                  "served by engine 1 / 2"], rows), ""]
    phases = sorted({p for d in phase_delta.values() for p in d})
    out += ["Sluice's handler time per request, by ext_proc phase (µs; `sluice_extproc_phase_seconds` "
            "over the same requests, divided by the requests):", "",
            table(["phase", *stack.variants],
                  [[p, *(f"{med(phase_delta[v][p]):.0f}" if p in phase_delta[v] else "–" for v in stack.variants)]
                   for p in phases]
                  + [["total", *(f"{sum(med(x) for x in phase_delta[v].values()):.0f}" for v in stack.variants)]]),
            ""]
    best = med(added50["access_log"])
    out += [f"Target: the demo adds ≤ {TARGET_ADDED_P50_MS} ms p50 over the engine called directly "
            f"(access_log): {best:+.2f} ms, {'met' if best <= TARGET_ADDED_P50_MS else '**missed**'}; "
            f"of it, Envoy on the same config without the ext_proc filter adds {med(added50[PLAIN]):+.2f} ms.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.demo_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--baseline-tree", type=Path, help="a checkout whose Sluice and Envoy config to run beside")
    args = ap.parse_args(argv)
    print(run(args.rounds, args.requests, args.baseline_tree, lambda s: print(s, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
