"""How late settles come from Envoy's access log, under 64 streaming clients, and that none is lost.

    python -m bench.settle_lag [--clients 64] [--seconds 20] [--tokens 40] [--tps 50]

The simulated engine (``bench.simbackend``), one Sluice with ``response_processing:
access_log`` and one Envoy. ``--clients`` clients each stream chat completions one after
the other for ``--seconds`` (``--tokens`` tokens at ``--tps`` per second each; every
fourth asks for usage itself, the others have it asked for on their behalf and hidden).
Then, once nothing is in flight:

- the settle lag, from a response's last byte (Envoy's ``time_to_last_downstream_tx_byte``)
  to its settle from the access log (``sluice_settle_lag_seconds``: the bucket that holds
  the median and the 99th percentile, and the mean);
- where the settles came from: the access log, or an expiry (an entry that never came);
  entries late or unknown;
- nothing lost: the requests the engine completed (its ``vllm:request_success_total``)
  against the requests Sluice settled from their entries, the tokens the engine counted
  (``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``) against the tokens
  Sluice charged, nothing in flight, the ledger balanced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.overhead import envoy_binary
from bench.procs import ProcGroup, free_port, get_json, http_ok, wait_idle
from bench.report import table
from extproc.policy.schema import hash_key

KEY = "sk-bench-lag"
MODEL = "sim-llama-8b"
TARGET_P99_S = 0.1


def policy(port: int, clients: int) -> dict[str, Any]:
    return {
        "gateway": {"response_processing": "access_log", "default_max_tokens": 256},
        "backends": [{"name": "sim", "address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
                      "max_concurrency": 4 * clients,
                      "models": [{"name": MODEL, "context_window": 4096, "encoding": "cl100k_base"}]}],
        "tiers": {"bench": {"priority": 100, "tpm": 10**10, "rpm": 10**9, "max_concurrency": 4 * clients}},
        "tenants": [{"name": "bench", "tier": "bench", "keys": [hash_key(KEY)]}],
    }


class Stack(ProcGroup):
    def __init__(self, workdir: Path, clients: int) -> None:
        super().__init__(workdir)
        self.clients = clients
        self.sim, self.grpc, self.admin, self.listen, self.envoy_admin = (free_port() for _ in range(5))

    def start(self) -> None:
        from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap

        envoy_binary()
        py = sys.executable
        # KV for every client's stream at once: no queueing, no preemption in the way.
        self.start_proc("sim", [py, "-m", "bench.simbackend", "--port", str(self.sim), "--kv-blocks", "32768"],
                        lambda: http_ok(f"http://127.0.0.1:{self.sim}/health"))
        pol = self.dir / "policies"
        pol.mkdir()
        (pol / "policy.yaml").write_text(yaml.safe_dump(policy(self.sim, self.clients), sort_keys=False))
        self.start_proc("sluice", [py, "-m", "extproc", "serve", "--policy", str(pol), "--grpc",
                                   f"127.0.0.1:{self.grpc}", "--admin", f"127.0.0.1:{self.admin}"],
                        lambda: http_ok(f"http://127.0.0.1:{self.admin}/healthz"))
        opts = EnvoyOptions(listen_port=self.listen, admin_port=self.envoy_admin, extproc_port=self.grpc,
                            response_processing="access_log", drain_port=self.admin)
        cfg = render_bootstrap([BackendRoute("sim", "127.0.0.1", self.sim, (MODEL,))], opts)
        self.start_envoy("envoy", cfg, self.envoy_admin, 1)

    def text(self, port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()


def sample(text: str, name: str, labels: str | None = None) -> float:
    """One series' value (``labels`` as written, ``""`` for none), or the sum of every series."""
    if labels is not None:
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    out = [(float("inf") if le == "+Inf" else float(le), float(v))
           for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)]
    return sorted(out)


def quantile_bound(bs: list[tuple[float, float]], q: float) -> float:
    total = bs[-1][1] if bs else 0.0
    return next((le for le, n in bs if n >= q * total), float("inf"))


async def client(url: str, i: int, until: float, tokens: int, tps: int, done: list[int]) -> None:
    asked = i % 4 == 0
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": tokens + 8,
                            "messages": [{"role": "user", "content": f"client {i} says hello"}]}
    if asked:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {KEY}", "x-sim-tokens": str(tokens), "x-sim-tps": str(tps)}
    async with httpx.AsyncClient(timeout=60) as c:
        while time.monotonic() < until:
            async with c.stream("POST", url, json=body, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    pass
                done.append(r.status_code)


def run(clients: int, seconds: float, tokens: int, tps: int, log: Any = print) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="sluice-lag-"))
    stack = Stack(workdir, clients)
    try:
        stack.start()
        url = f"http://127.0.0.1:{stack.listen}/v1/chat/completions"
        done: list[int] = []
        log(f"{clients} clients streaming for {seconds:g} s")

        async def all_clients() -> None:
            until = time.monotonic() + seconds
            await asyncio.gather(*(client(url, i, until, tokens, tps, done) for i in range(clients)))

        asyncio.run(all_clients())
        st = wait_idle(f"http://127.0.0.1:{stack.admin}/debug/state", 30, 0.05)
        time.sleep(0.5)  # a late or duplicate entry would have come by now
        st = get_json(f"http://127.0.0.1:{stack.admin}/debug/state")
        sluice, engine = stack.text(stack.admin), stack.text(stack.sim)
        envoy = {s["name"].rsplit(".", 1)[-1]: s.get("value", 0) for s in get_json(
            f"http://127.0.0.1:{stack.envoy_admin}/stats?format=json&filter=grpc_access_log")["stats"]}
    finally:
        stack.stop()
        log(f"logs in {workdir}")
    lag = buckets(sluice, "sluice_settle_lag_seconds")
    count, total = (
        sample(sluice, "sluice_settle_lag_seconds_count", ""),
        sample(sluice, "sluice_settle_lag_seconds_sum", ""),
    )
    from_log = sample(sluice, "sluice_access_log_entries_total", '{outcome="settled"}')
    expired = sample(sluice, "sluice_access_log_expired_total", "")
    late = sample(sluice, "sluice_access_log_entries_total", '{outcome="late"}')
    unknown = sample(sluice, "sluice_access_log_entries_total", '{outcome="unknown"}')
    completed = sample(engine, "vllm:request_success_total")
    engine_tokens = sample(engine, "vllm:prompt_tokens_total") + sample(engine, "vllm:generation_tokens_total")
    ledger = st["ledger"]
    ok = sum(1 for s in done if s == 200)
    p50, p99 = quantile_bound(lag, 0.5), quantile_bound(lag, 0.99)
    rows = [
        ["streams completed by clients (200)", f"{ok:,} of {len(done):,}"],
        ["requests the engine completed (vllm:request_success_total)", f"{completed:,.0f}"],
        ["settled from the access log", f"{from_log:,.0f} ({from_log / max(1.0, from_log + expired):.1%})"],
        ["settled by expiry", f"{expired:,.0f}"],
        ["entries late / unknown (ignored)", f"{late:,.0f} / {unknown:,.0f}"],
        ["Envoy: entries written / dropped / flushes failed", f"{envoy.get('logs_written', 0):,} / "
         f"{envoy.get('logs_dropped', 0):,} / {envoy.get('grpc_entries_flush_failed', 0):,}"],
        ["settle lag p50 / p99 (bucket bounds)", f"≤ {p50 * 1e3:.0f} ms / ≤ {p99 * 1e3:.0f} ms"],
        ["settle lag mean", f"{total / max(count, 1) * 1e3:.1f} ms"],
        ["tokens the engine counted (prompt + generation)", f"{engine_tokens:,.0f}"],
        ["tokens Sluice charged", f"{ledger['charged']:,}"],
        ["in flight after / ledger balanced", f"{st['in_flight']} / {ledger['balanced']}"],
    ]
    lost = completed - from_log - expired
    out = [f"{clients} streaming clients for {seconds:g} s ({tokens} tokens at {tps}/s per stream), "
           "response_processing: access_log, one Sluice process:", "", table(["", "value"], rows), "",
           f"Target: settle lag p99 ≤ {TARGET_P99_S * 1e3:.0f} ms: {'met' if p99 <= TARGET_P99_S else '**missed**'}; "
           f"0 lost: {lost:.0f} lost ({'met' if lost == 0 and expired == 0 else '**missed**'}); "
           f"ledger balanced: {'met' if ledger['balanced'] and st['in_flight'] == 0 else '**missed**'}.", ""]
    out.append("```\n" + json.dumps({"lag_buckets": lag}, default=str) + "\n```")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.settle_lag", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--tps", type=int, default=50)
    args = ap.parse_args(argv)
    print(run(args.clients, args.seconds, args.tokens, args.tps, lambda s: print(s, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
