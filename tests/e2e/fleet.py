"""Several extproc replicas behind ONE Envoy, sharing one real ``redis-server``.

The harness's ``Stack`` with its single extproc replaced by ``n`` processes (each its
own gRPC and admin port and replica id ``r1``…), all endpoints of Envoy's
``sluice_extproc`` cluster, so Envoy balances the ext_proc streams across them (round
robin, one HTTP/2 connection per replica). Samplers read the ground truth every 10 ms
from the simulated backend's ``/metrics`` and the replicas' ``/debug/state``.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from bench.procs import Proc, free_port, get_json, tails, wait_http, wait_idle
from bench.redis_server import RedisServer
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, write_config
from extproc.policy.schema import build_policy
from tests.e2e.harness import Stack, envoy_binary


@dataclass
class Fleet(Stack):
    replicas: int = 3
    redis: RedisServer | None = None
    grpc_ports: list[int] = field(default_factory=list)
    admin_ports: list[int] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.grpc_ports = [self.grpc_port] + [free_port() for _ in range(self.replicas - 1)]
        self.admin_ports = [self.admin_port] + [free_port() for _ in range(self.replicas - 1)]

    def name(self, i: int) -> str:
        return "extproc" if i == 0 else f"extproc-{i + 1}"

    def start_extproc(self) -> None:
        for i in range(self.replicas):
            self.start_replica(i)

    def start_replica(self, i: int) -> None:
        p = Proc(self.name(i), [sys.executable, "-m", "extproc", "serve", "--policy", str(self.policy_dir),
                                "--grpc", f"127.0.0.1:{self.grpc_ports[i]}",
                                "--admin", f"127.0.0.1:{self.admin_ports[i]}", "--replica-id", f"r{i + 1}",
                                "--reload-interval", "0.2"], self.workdir / f"{self.name(i)}.log")
        self.procs[self.name(i)] = p.start()
        wait_http(f"http://127.0.0.1:{self.admin_ports[i]}/healthz", proc=p.popen)

    def start_envoy(self) -> None:
        assert self.policy_doc is not None
        policy = build_policy(self.policy_doc)
        opts = EnvoyOptions(listen_port=self.envoy_port, admin_port=self.envoy_admin_port,
                            extproc_port=self.grpc_ports[0],
                            extproc_more=tuple(("127.0.0.1", p) for p in self.grpc_ports[1:]),
                            drain_port=self.admin_port,
                            **policy_options(policy))  # type: ignore[arg-type]
        cfg = write_config(self.workdir / "envoy.yaml", [BackendRoute("sim", "127.0.0.1", self.sim_port)], opts)
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for name in ["envoy", *(self.name(i) for i in range(self.replicas)), "sim"]:
            if name in self.procs:
                self.procs[name].stop()

    def logs(self) -> str:
        return tails(self.procs.values(), lines=25)

    def admin(self, i: int) -> str:
        return f"http://127.0.0.1:{self.admin_ports[i]}"

    def states(self) -> list[dict[str, Any]]:
        """Every replica's ``/debug/state``, fetched at once (one thread each: a sample of
        all of them takes one round trip, not ``replicas``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.replicas)
        return list(self._pool.map(get_json, [f"{self.admin(i)}/debug/state" for i in range(self.replicas)]))

    def wait_settled_all(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        return [wait_idle(f"{self.admin(i)}/debug/state", timeout, interval=0.02) for i in range(self.replicas)]


def start_fleet(workdir: Path, replicas: int, policy: Callable[[int], dict[str, Any]],
                sim_args: list[str] | None = None) -> Fleet:
    """A redis-server, then the fleet; ``policy(sim_port)`` is the policy (its state: that Redis)."""
    redis = RedisServer(workdir / "redis").start()
    f = Fleet(workdir, sim_args=sim_args or [], replicas=replicas, redis=redis)
    f.policy_doc = policy(f.sim_port)
    f.policy_doc.setdefault("gateway", {})["state"] = redis.url
    try:
        f.start()
    except Exception:
        f.stop()
        redis.stop()
        print(f.logs())
        raise
    return f


def stop_fleet(f: Fleet) -> None:
    f.stop()
    if f.redis is not None:
        f.redis.stop()


# -- ground truth, sampled ---------------------------------------------------------------
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.M)


def backend_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=2) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in _METRIC.findall(text):
        if not labels or labels.count("=") == 1:  # unlabelled or {model_name=...} only
            out[name] = float(value)
    return out


class Sampler(threading.Thread):
    """Calls ``read`` every ``interval`` s until stopped; keeps (monotonic time, value)."""

    def __init__(self, read: Any, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.read, self.interval = read, interval
        self.samples: list[tuple[float, Any]] = []
        self.errors = 0
        self._stop_ev = threading.Event()

    def run(self) -> None:
        while not self._stop_ev.is_set():
            t0 = time.monotonic()
            try:
                v = self.read()
            except OSError:
                self.errors += 1
            else:
                self.samples.append(((t0 + time.monotonic()) / 2, v))
            self._stop_ev.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def stop(self) -> list[tuple[float, Any]]:
        self._stop_ev.set()
        self.join(5)
        return self.samples

    def gaps(self) -> tuple[float, float]:
        """Median and largest interval between samples, in seconds."""
        ts = [t for t, _ in self.samples]
        d = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
        return (d[len(d) // 2], d[-1]) if d else (0.0, 0.0)


class ClientThreads:
    """``clients`` daemon threads that each run ``_run`` (a loop until ``_stop`` is set) inside ``with``."""

    def __init__(self, clients: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


async def post_counted(http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                       codes: dict[str, int], rng: random.Random, cap_s: float) -> httpx.Response | None:
    """POST a chat completion to ``url``; count its outcome in ``codes``: "200", "<status> <x-sluice-reason>",
    or the transport error's name (then None, returned 0.1 s later). A refusal is returned after waiting out
    its retry-after-ms (200 ms if absent) within [20 ms, ``cap_s``], jittered up to +30 %."""
    try:
        r = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
        await asyncio.sleep(0.1)
        return None
    key = str(r.status_code) + ("" if r.status_code == 200 else f" {r.headers.get('x-sluice-reason')}")
    codes[key] = codes.get(key, 0) + 1
    if r.status_code != 200:
        wait = float(r.headers.get("retry-after-ms", "200")) / 1000
        await asyncio.sleep(min(cap_s, max(0.02, wait)) * rng.uniform(1.0, 1.3))
    return r
