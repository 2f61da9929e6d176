"""``make demo``: the whole stack on loopback with the example policy.

Starts the simulated backend, extproc, (the console when present) and Envoy, prints
where everything is, and stops all of it on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.procs import find_envoy
from bench.redis_server import RedisServer
from extproc.store import ENV_URL

ROOT = Path(__file__).resolve().parents[1]
# REPLICAS > 1: replica i (from 0) serves gRPC on 50051 + i and admin on 9100 + i; they
# share a redis-server on 6380 (not 6379, where a system Redis may already run).
GRPC_PORT, ADMIN_PORT, REDIS_PORT = 50051, 9100, 6380
EDS_DIR = "var/eds"  # the pool's endpoint set for Envoy (extproc.envoy.eds), relative to ROOT
# The simulated engines, by port: the sim-llama-8b pool's two (the second with half the
# KV cache of the first) model vLLM's prefix cache, which the policy's prefix_affinity
# steers to; 8001 serves sim-llama-1b, the fallback.
ENGINES: dict[int, tuple[str, ...]] = {
    8000: ("--enable-prefix-caching",),
    8001: ("--model", "sim-llama-1b"),
    8002: ("--kv-blocks", "1024", "--enable-prefix-caching"),
}


def wait(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}; see the log above")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {url}")


def banner(replicas: int, redis_url: str | None) -> str:
    """What the demo prints once everything is up."""
    lines = "\n".join(f"  extproc  -> demo-{i + 1}: gRPC 127.0.0.1:{GRPC_PORT + i}, "
                      f"http://127.0.0.1:{ADMIN_PORT + i}/metrics  /healthz  /debug/state"
                      for i in range(replicas))
    if redis_url:
        lines += f"\n  redis    -> {redis_url}   (slots, KV, TPM/RPM and breaker trips shared)"
    return f"""
Sluice demo is up (Ctrl-C stops everything):
  clients  -> http://127.0.0.1:10000/v1/chat/completions   (keys: sk-demo-premium, sk-demo-free, sk-demo-batch)
  console  -> http://127.0.0.1:8080/   (operator credentials printed above)
{lines}
  envoy    -> http://127.0.0.1:9901/
  backends -> sim-llama-8b: a pool of two simulated vLLM engines, Sluice picks the endpoint;
              prefix affinity on: a prompt prefix goes back to the engine that served it,
              both engines run with --enable-prefix-caching (Overview: hit / spill / miss)
              http://127.0.0.1:8000/metrics  (endpoint 1: 32,768 tokens of KV cache)
              http://127.0.0.1:8002/metrics  (endpoint 2: 16,384 tokens of KV cache)
              http://127.0.0.1:8001/metrics  (simulated vLLM, sim-llama-1b: the fallback)

try:
  curl -s http://127.0.0.1:10000/v1/chat/completions -H 'authorization: Bearer sk-demo-premium' \\
       -H 'content-type: application/json' \\
       -d '{{"model":"sim-llama-8b","messages":[{{"role":"user","content":"hello"}}]}}'
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default=str(ROOT / "policies"))
    ap.add_argument("--time-scale", default="1.0", help="simulated backend speed-up")
    ap.add_argument("--replicas", type=int, default=1,
                    help=f"extproc replicas; more than 1 share a local redis-server on port {REDIS_PORT}")
    args = ap.parse_args()
    py = sys.executable
    envoy = find_envoy()
    cfg = ROOT / "envoy" / "demo.yaml"
    grpc = ",".join(f"127.0.0.1:{GRPC_PORT + i}" for i in range(args.replicas))
    (ROOT / "var").mkdir(mode=0o700, exist_ok=True)
    # The pool's endpoint files: written first by envoy-config, then by every replica on
    # each reload (the console's policy too). Relative: Envoy and extproc run in ROOT.
    eds = ["--eds-dir", EDS_DIR]
    subprocess.run([py, "-m", "extproc", "envoy-config", args.policy, "-o", str(cfg), "--extproc", grpc, *eds],
                   check=True, cwd=ROOT)
    procs: list[subprocess.Popen] = []
    stop_redis: list[Callable[[], None]] = []

    def start(*cmd: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(list(cmd), cwd=ROOT, env={**os.environ, **(env or {})})
        procs.append(p)
        return p

    try:
        engines = {port: start(py, "-m", "bench.simbackend", "--port", str(port), *flags,
                               "--time-scale", args.time_scale) for port, flags in ENGINES.items()}
        for port, engine in engines.items():
            wait(f"http://127.0.0.1:{port}/health", engine)
        # The replica token goes through the environment, not the command line (``ps`` shows
        # every user the command line; /proc/PID/environ only the owner).
        secret = {"SLUICE_CONSOLE_TOKEN": secrets.token_urlsafe(24)}
        con = start(py, "-m", "console", "serve", "--db", str(ROOT / "var" / "console.db"), "--policy", args.policy,
                    "--host", "127.0.0.1", "--port", "8080", "--demo", env=secret)
        wait("http://127.0.0.1:8080/healthz", con)
        store = {}
        if args.replicas > 1:
            redis = RedisServer(ROOT / "var" / "redis", port=REDIS_PORT).start()
            stop_redis.append(redis.stop)
            store = {ENV_URL: redis.url}
        for i in range(args.replicas):
            ep = start(py, "-m", "extproc", "serve", "--policy", args.policy, "--console-url",
                       "http://127.0.0.1:8080", "--replica-id", f"demo-{i + 1}",
                       "--grpc", f"127.0.0.1:{GRPC_PORT + i}", "--admin", f"127.0.0.1:{ADMIN_PORT + i}", *eds,
                       env={**secret, **store})
            wait(f"http://127.0.0.1:{ADMIN_PORT + i}/healthz", ep)
        env = start(str(envoy), "-c", str(cfg), "--disable-hot-restart", "-l", "warning")
        wait("http://127.0.0.1:9901/ready", env)
        print(banner(args.replicas, store.get(ENV_URL)), flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a component exited; stopping the demo", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        for stop in stop_redis:
            stop()
        print("demo stopped")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sys.exit(main())
