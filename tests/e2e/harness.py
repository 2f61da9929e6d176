"""Start the real stack on random loopback ports: simulated backend, extproc, Envoy.

Every process logs to a file under the test's temp dir; ``Stack.logs()`` returns the
tails, which the fixtures print when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.procs import ROOT, Proc, envoy_binary, free_port, get_json, tails, wait_http, wait_idle
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, write_config
from extproc.policy.schema import build_policy, hash_key
from tests.waiting import eventually

__all__ = ["ROOT", "TEST_KEYS", "Proc", "Stack", "envoy_binary", "eventually", "free_port", "get_json",
           "running", "test_policy", "wait_http"]



TEST_KEYS = {
    "premium": "sk-test-premium",
    "free": "sk-test-free",
    "tiny": "sk-test-tiny",
    "other": "sk-test-other",
    "shadow": "sk-test-shadow",
}


def test_policy(backend_port: int, **gateway: Any) -> dict[str, Any]:
    """A policy shaped for tests: small budgets where a test wants to exhaust them."""
    return {
        "gateway": {"max_body_bytes": 256 * 1024, "default_max_tokens": 128, "message_timeout_ms": 5000,
                    **gateway},
        "backends": [{
            "name": "sim", "address": f"127.0.0.1:{backend_port}",
            "metrics_url": f"http://127.0.0.1:{backend_port}/metrics", "max_concurrency": 64,
            "models": [{"name": "sim-llama-8b", "context_window": 4096, "encoding": "cl100k_base"},
                       {"name": "sim-o200k", "context_window": 8192, "encoding": "o200k_base"}],
        }],
        "tiers": {
            "premium": {"priority": 100, "tpm": 1_000_000, "rpm": 100_000, "max_concurrency": 256},
            "free": {"priority": 10, "tpm": 200_000, "rpm": 100_000, "max_concurrency": 256},
            "tiny": {"priority": 0, "tpm": 600, "rpm": 100_000, "max_concurrency": 256},
            # A new, tight limit rolled out in shadow mode: decided and recorded, not enforced.
            "shadowed": {"priority": 0, "tpm": 100, "rpm": 100_000, "shadow": ["tpm"]},
        },
        "tenants": [
            {"name": "t-premium", "tier": "premium", "keys": [hash_key(TEST_KEYS["premium"])]},
            {"name": "t-free", "tier": "free", "keys": [hash_key(TEST_KEYS["free"])]},
            {"name": "t-tiny", "tier": "tiny", "keys": [hash_key(TEST_KEYS["tiny"])]},
            {"name": "t-other", "tier": "tiny", "keys": [hash_key(TEST_KEYS["other"])]},
            {"name": "t-shadow", "tier": "shadowed", "keys": [hash_key(TEST_KEYS["shadow"])]},
        ],
    }


@dataclass
class Stack:
    workdir: Path
    sim_args: list[str] = field(default_factory=list)
    gateway: dict[str, Any] = field(default_factory=dict)
    policy_doc: dict[str, Any] | None = None
    procs: dict[str, Proc] = field(default_factory=dict)
    extproc_args: list[str] = field(default_factory=list)  # more of serve's options

    def __post_init__(self) -> None:
        self.sim_port = free_port()
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.envoy_port = free_port()
        self.envoy_admin_port = free_port()
        self.policy_dir = self.workdir / "policies"
        self.policy_dir.mkdir(parents=True, exist_ok=True)
        self.eds_dir = self.workdir / "eds"  # a pool's endpoint set, written by extproc (--eds-dir)
        if self.policy_doc is None:
            self.policy_doc = test_policy(self.sim_port, **self.gateway)

    # -- URLs ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    # -- lifecycle ----------------------------------------------------------
    def write_policy(self, doc: dict[str, Any] | None = None) -> None:
        doc = doc or self.policy_doc
        (self.policy_dir / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    def start(self) -> Stack:
        self.write_policy()
        self.start_sim()
        self.start_extproc()
        self.start_envoy()
        return self

    def start_sim(self) -> None:
        p = Proc("simbackend", [sys.executable, "-m", "bench.simbackend", "--host", "127.0.0.1",
                                "--port", str(self.sim_port), *self.sim_args], self.workdir / "sim.log")
        self.procs["sim"] = p.start()
        wait_http(f"{self.sim_url}/health", proc=p.popen)

    def start_extproc(self) -> None:
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(self.policy_dir),
                             "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}",
                             "--reload-interval", "0.2", "--eds-dir", str(self.eds_dir), *self.extproc_args],
                 self.workdir / "extproc.log")
        self.procs["extproc"] = p.start()
        wait_http(f"{self.admin_url}/healthz", proc=p.popen)

    def start_envoy(self) -> None:
        assert self.policy_doc is not None
        policy = build_policy(self.policy_doc)
        opts = EnvoyOptions(listen_port=self.envoy_port, admin_port=self.envoy_admin_port,
                            extproc_port=self.grpc_port, drain_port=self.admin_port, eds_dir=str(self.eds_dir),
                            **policy_options(policy))  # type: ignore[arg-type]
        # A pool (the first backend lists endpoints) gets the EDS cluster; extproc, started
        # first, has written its endpoint file.
        routes = [BackendRoute("sim", "127.0.0.1", self.sim_port, pool=policy.backends[0].is_pool)]
        cfg = write_config(self.workdir / "envoy.yaml", routes, opts)
        # access-log lines reach envoy.log within 0.25 s (the default flush interval is 10 s)
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1", "--file-flush-interval-msec", "250"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)

    def stop(self) -> None:
        for name in ("envoy", "extproc", "sim"):
            if name in self.procs:
                self.procs[name].stop()

    def logs(self) -> str:
        return tails(self.procs.values(), lines=25)

    # -- introspection --------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return get_json(f"{self.admin_url}/debug/state")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric_sum(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s series on extproc's /metrics whose labels include ``labels``."""
        want = {f'{k}="{v}"' for k, v in labels.items()}
        total = 0.0
        for line in self.metrics_text().splitlines():
            series, _, value = line.rpartition(" ")
            if series.startswith(name + "{") and want <= set(series[len(name) + 1:-1].split(",")):
                total += float(value)
        return total

    def access_log(self) -> list[dict[str, Any]]:
        """Envoy's access-log entries so far (its JSON lines in envoy.log, 0.25 s behind)."""
        lines = (self.workdir / "envoy.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def sim_requests(self) -> list[dict[str, Any]]:
        return get_json(f"{self.sim_url}/admin/requests")

    def clear_sim_requests(self) -> None:
        req = urllib.request.Request(f"{self.sim_url}/admin/requests", method="DELETE")
        urllib.request.urlopen(req, timeout=5).read()

    def wait_settled(self, timeout: float = 3.0) -> dict[str, Any]:
        """Poll until nothing is in flight; return the final state."""
        return wait_idle(f"{self.admin_url}/debug/state", timeout, interval=0.02)


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    """Start the stack for a test module; print every log if it fails to come up."""
    try:
        stack.start()
    except Exception:
        stack.stop()
        print(stack.logs())
        raise
    try:
        yield stack
    finally:
        stack.stop()
