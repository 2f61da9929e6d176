"""A pool of three simulated engines of different KV sizes: who places the requests?

    python -m bench.pool [--requests 36] [--workdir DIR]

The same burst (``--requests`` long prompts at once, ~3x what the pool's caches hold)
through the same Sluice admission (one budget, the sum of the three engines') and the
real Envoy, three ways:

- ``round_robin``: Envoy's ROUND_ROBIN over the three engines (Sluice does not place);
- ``least_request``: Envoy's LEAST_REQUEST over them;
- ``sluice``: the backend is a pool; Sluice places each request
  (``extproc.policy.placement``) and Envoy's ORIGINAL_DST cluster follows.

Reported per configuration: preemptions and KV peak per engine, completion tokens/s
(goodput), and TTFT p50/p99 measured by the client (streaming). A simplified form of
the issue's conversation-trace comparison: one tier, one burst.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.procs import Proc, envoy_binary, free_port, get_json, wait_http, wait_idle
from extproc.envoyconfig import BackendRoute, EnvoyOptions, gateway_options, render_bootstrap
from extproc.policy.schema import build_policy, hash_key

BLOCK = 16
ENGINES = (128, 256, 512)  # KV blocks: 2,048, 4,096 and 8,192 tokens
SIM = ["--block-size", str(BLOCK), "--time-scale", "5", "--max-num-seqs", "64", "--max-model-len", "4096"]
KEY = "sk-bench-pool"
PROMPT_WORDS, MAX_TOKENS = 900, 250
CONFIGS = ("round_robin", "least_request", "sluice")


def policy(ports: list[int], pool: bool) -> dict[str, Any]:
    caps = [b * BLOCK for b in ENGINES]
    backend: dict[str, Any] = {"name": "sim", "kv_block_size": BLOCK, "max_concurrency": 16,
                               "watermark": {"scrape_interval_s": 0.2},
                               "breaker": {"trip_on_preemption": False},
                               "models": [{"name": "sim-llama-8b", "context_window": 4096}]}
    if pool:
        backend["endpoints"] = [{"address": f"127.0.0.1:{p}", "metrics_url": f"http://127.0.0.1:{p}/metrics",
                                 "kv_capacity_tokens": c} for p, c in zip(ports, caps, strict=True)]
    else:
        # The same budget, but Envoy places: Sluice sees one backend of the summed size.
        backend.update(address=f"127.0.0.1:{ports[0]}", kv_capacity_tokens=sum(caps),
                       max_concurrency=16 * len(ports))
    return {"gateway": {"max_body_bytes": 1 << 20, "message_timeout_ms": 5000},
            "backends": [backend],
            "tiers": {"premium": {"priority": 1, "tpm": 100_000_000, "rpm": 1_000_000,
                                  "max_queue_wait_ms": 60_000, "max_queue_depth": 256}},
            "tenants": [{"name": "t", "tier": "premium", "keys": [hash_key(KEY)]}]}


def envoy_config(doc: dict[str, Any], ports: list[int], lb: str | None, listen: int, admin: int, grpc: int,
                 drain: int) -> dict[str, Any]:
    gw = build_policy(doc).gateway
    opts = EnvoyOptions(listen_port=listen, admin_port=admin, extproc_port=grpc, drain_port=drain,
                        **gateway_options(gw))  # type: ignore[arg-type]
    cfg = render_bootstrap([BackendRoute("sim", "127.0.0.1", ports[0], pool=True)], opts)
    if lb is not None:  # the same cluster (usage filters included), balanced by Envoy instead
        c = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "sim")
        for k in ("original_dst_lb_config", "cleanup_interval"):
            c.pop(k, None)
        c.update(type="STATIC", lb_policy=lb, load_assignment={"cluster_name": "sim", "endpoints": [{
            "lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                          "port_value": p}}}} for p in ports]}]})
    return cfg


def one(url: str) -> tuple[int, float | None, int]:
    body = {"model": "sim-llama-8b", "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "word " * PROMPT_WORDS}]}
    t0 = time.monotonic()
    ttft, tokens = None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}", "x-sim-tokens": str(MAX_TOKENS)}) as r:
        for line in r.iter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.monotonic() - t0
            if '"completion_tokens"' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
        return r.status_code, ttft, tokens


def run_config(name: str, workdir: Path, n: int) -> dict[str, Any]:
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in ENGINES]
    grpc, admin, listen, envoy_admin = free_port(), free_port(), free_port(), free_port()
    doc = policy(ports, pool=name == "sluice")
    (d / "policy").mkdir(exist_ok=True)
    (d / "policy" / "policy.yaml").write_text(yaml.safe_dump(doc))
    lb = {"round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST"}.get(name)
    (d / "envoy.yaml").write_text(yaml.safe_dump(envoy_config(doc, ports, lb, listen, envoy_admin, grpc, admin)))
    procs = []
    try:
        for p, blocks in zip(ports, ENGINES, strict=True):
            procs.append(Proc(f"sim-{p}", [sys.executable, "-m", "bench.simbackend", "--port", str(p),
                                           "--kv-blocks", str(blocks), *SIM], d / f"sim-{p}.log").start())
            wait_http(f"http://127.0.0.1:{p}/health", proc=procs[-1].popen)
        procs.append(Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(d / "policy"),
                                      "--grpc", f"127.0.0.1:{grpc}", "--admin", f"127.0.0.1:{admin}"],
                          d / "extproc.log").start())
        wait_http(f"http://127.0.0.1:{admin}/healthz", proc=procs[-1].popen)
        procs.append(Proc("envoy", [envoy_binary(), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l",
                                    "warning", "--concurrency", "1"], d / "envoy.log").start())
        wait_http(f"http://127.0.0.1:{envoy_admin}/ready", proc=procs[-1].popen)
        time.sleep(1.0)  # first scrapes
        url = f"http://127.0.0.1:{listen}"
        t0 = time.monotonic()
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda _: one(url), range(n)))
        wall = time.monotonic() - t0
        wait_idle(f"http://127.0.0.1:{admin}/debug/state", 30)
        engines = [get_json(f"http://127.0.0.1:{p}/admin/engine") for p in ports]
    finally:
        for p in reversed(procs):
            p.stop()
    ttfts = sorted(t for s, t, _ in results if s == 200 and t is not None)
    return {
        "ok": sum(1 for s, _, _ in results if s == 200), "n": n, "wall_s": wall,
        "goodput_tok_s": sum(tok for s, _, tok in results if s == 200) / wall,
        "preemptions": [e["preemptions_total"] for e in engines],
        "kv_peak": [f"{e['kv_blocks_peak']}/{b}" for e, b in zip(engines, ENGINES, strict=True)],
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
    }


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    out = ["| placement | ok | preemptions per engine (2k/4k/8k) | KV peak blocks | goodput tok/s | "
           "TTFT p50 s | TTFT p99 s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        out.append(f"| {name} | {r['ok']}/{r['n']} | {' / '.join(str(int(x)) for x in r['preemptions'])} | "
                   f"{' / '.join(r['kv_peak'])} | {r['goodput_tok_s']:.0f} | {r['ttft_p50_s']:.2f} | "
                   f"{r['ttft_p99_s']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sluice-pool-"))
    rows = {name: run_config(name, workdir, args.requests) for name in args.configs.split(",")}
    print(markdown(rows))


if __name__ == "__main__":
    main()
