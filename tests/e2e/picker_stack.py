"""Sluice as a gateway's endpoint picker: three simulated engines (one InferencePool), Sluice
serving ``--picker`` over TLS, and the real Envoy under a gateway's config
(``tests.e2e.gateway_configs``), all on random loopback ports."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from extproc.policy.schema import hash_key
from tests.e2e import gateway_configs as gc
from tests.e2e.harness import TEST_KEYS, Proc, Stack, envoy_binary, free_port, wait_http
from tests.e2e.pool_stack import start_engine, stop_engine

ENGINES = 3
BLOCK = 16
ENGINE_ARGS = ["--block-size", str(BLOCK), "--kv-blocks", "512", "--time-scale", "5", "--max-num-seqs", "64",
               "--max-model-len", "4096"]
MODEL = "sim-llama-8b"

Render = Callable[["PickerStack"], dict[str, Any]]


def picker_policy(ports: list[int], **gateway: Any) -> dict[str, Any]:
    """A pool of the engines; the harness's tiers and keys (budgets a test can exhaust)."""
    return {
        "gateway": {"max_body_bytes": 256 * 1024, "default_max_tokens": 128, "message_timeout_ms": 5000, **gateway},
        "backends": [{
            # Above the conformance burst (100 at once): those tests check where requests land, and
            # under the suite's load enough of them overlap to fill 32 slots (two 429s in a CI run).
            "name": "pool", "max_concurrency": 128, "kv_block_size": BLOCK,
            "endpoints": [{"address": f"127.0.0.1:{p}", "metrics_url": f"http://127.0.0.1:{p}/metrics",
                           "kv_capacity_tokens": 512 * BLOCK} for p in ports],
            "watermark": {"smoothing": 1.0, "recover_per_s": 0.5, "scrape_interval_s": 0.1, "stale_after_s": 2},
            "models": [{"name": MODEL, "context_window": 4096, "encoding": "cl100k_base"}],
        }],
        "tiers": {
            "premium": {"priority": 100, "tpm": 1_000_000, "rpm": 100_000, "max_concurrency": 256},
            "tiny": {"priority": 0, "tpm": 600, "rpm": 100_000, "max_concurrency": 256},
        },
        "tenants": [
            {"name": "t-premium", "tier": "premium", "keys": [hash_key(TEST_KEYS["premium"])]},
            {"name": "t-tiny", "tier": "tiny", "keys": [hash_key(TEST_KEYS["tiny"])]},
        ],
    }


class PickerStack(Stack):
    def __init__(self, workdir: Path, render: Render, picker_args: tuple[str, ...] = ()) -> None:
        self.render = render
        self.label = "picker"  # the gateway's name in the tests that vary by it
        self.picker_args = picker_args
        self.engine_ports = [free_port() for _ in range(ENGINES)]
        self.picker_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.ready_port = free_port()
        super().__init__(workdir, policy_doc=picker_policy(self.engine_ports))

    @property
    def ports(self) -> gc.Ports:
        return gc.Ports(admin=self.envoy_admin_port, ready=self.ready_port, listener=self.envoy_port,
                        picker=self.picker_port)

    @property
    def engines(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.engine_ports]

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[i]}"

    def start_sim(self) -> None:
        for i, port in enumerate(self.engine_ports):
            start_engine(self, f"sim-{i}", port, ENGINE_ARGS, f"sim-{i}.log")

    def start_extproc(self) -> None:
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(self.policy_dir),
                             "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}",
                             "--reload-interval", "0.2", "--picker", f"127.0.0.1:{self.picker_port}",
                             "--picker-health", f"127.0.0.1:{self.health_port}",
                             "--picker-metrics", f"127.0.0.1:{self.metrics_port}", *self.picker_args],
                 self.workdir / "extproc.log")
        self.procs["extproc"] = p.start()
        wait_http(f"{self.admin_url}/healthz", proc=p.popen)

    def start_envoy(self) -> None:
        cfg = self.workdir / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(self.render(self), sort_keys=False))
        # The vendored Deployments name the node and cluster the same way (--service-*).
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1", "--service-cluster", "e2e/inference-gateway",
                           "--service-node", "envoy-e2e"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.ready_port}/ready", proc=p.popen)

    def stop(self) -> None:
        super().stop()
        for i in range(ENGINES):
            stop_engine(self, f"sim-{i}")

    def engine_requests(self, i: int) -> list[dict[str, Any]]:
        from tests.e2e.harness import get_json

        return get_json(f"{self.engine_url(i)}/admin/requests")

    def envoy_stat(self, name: str) -> int:
        import urllib.request

        url = f"http://127.0.0.1:{self.envoy_admin_port}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                k, _, v = line.partition(": ")
                if k == name:
                    return int(v)
        return 0


def render_vendored(name: str) -> Render:
    return lambda s: gc.relocate(gc.vendored(name), s.ports)


def render_aigw(body_mode: str = "FULL_DUPLEX_STREAMED") -> Render:
    return lambda s: gc.aigw(gc.relocate(gc.vendored("gie"), s.ports), body_mode)


def render_istio(fail_open: bool = True) -> Render:
    return lambda s: gc.istio(gc.relocate(gc.vendored("gie"), s.ports), s.engines, fail_open)
