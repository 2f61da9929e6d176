"""``extproc serve --workers 2`` on a Redis store, behind one Envoy: one tenant, one budget.

Each worker serves its own gRPC port and Envoy's ext_proc cluster lists both
(``envoy-config --extproc-workers 2``), so Envoy spreads the streams over them; the
tenant's TPM bucket, kept in Redis, holds across them.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from bench.procs import Proc, free_ports, wait_http, wait_idle
from bench.redis_server import RedisServer
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, write_config
from extproc.policy.schema import build_policy
from tests.e2e.harness import Stack, envoy_binary, running
from tests.e2e.test_datapath import auth, chat_body, post

pytestmark = pytest.mark.e2e

TINY_BURST = 600  # the tiny tier's bucket (tests/e2e/harness.py: test_policy), refilled at 10 tokens/s


class WorkersStack(Stack):
    """The harness's stack with ``--workers 2``: two gRPC ports, both in Envoy's cluster."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.grpc_port, self.admin_port = free_ports(2), free_ports(2)

    def start_extproc(self) -> None:
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy",
                             str(self.policy_dir), "--grpc", f"127.0.0.1:{self.grpc_port}",
                             "--admin", f"127.0.0.1:{self.admin_port}", "--replica-id", "w",
                             "--reload-interval", "0.2"], self.workdir / "extproc.log")
        self.procs["extproc"] = p.start()
        for i in range(2):
            wait_http(f"http://127.0.0.1:{self.admin_port + i}/healthz", proc=p.popen)

    def worker_metrics(self, i: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port + i}/metrics", timeout=5) as r:
            return r.read().decode()

    def start_envoy(self) -> None:
        assert self.policy_doc is not None
        policy = build_policy(self.policy_doc)
        opts = EnvoyOptions(listen_port=self.envoy_port, admin_port=self.envoy_admin_port,
                            extproc_port=self.grpc_port, extproc_more=(("127.0.0.1", self.grpc_port + 1),),
                            drain_port=self.admin_port, **policy_options(policy))  # type: ignore[arg-type]
        cfg = write_config(self.workdir / "envoy.yaml", [BackendRoute("sim", "127.0.0.1", self.sim_port)], opts)
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)


# access_log: each worker is its own access-log sink; an entry must come back to the
# worker that forwarded its request, or that request would wait for its expiry.
@pytest.fixture(scope="module", params=["usage_trailers", "access_log"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[WorkersStack]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()  # Debian's redis-server
    try:
        s = WorkersStack(tmp_path_factory.mktemp("workers"),
                         gateway={"state": redis.url, "response_processing": request.param})
        with running(s):
            yield s
    finally:
        redis.stop()


def test_two_workers_serve_and_share_one_tenants_budget(stack: WorkersStack) -> None:
    headers = {**auth("tiny"), "x-sim-tokens": "50"}
    started = time.monotonic()
    codes = [post(stack, chat_body(max_tokens=50), headers).status_code for _ in range(20)]
    elapsed = time.monotonic() - started
    states = [wait_idle(f"http://127.0.0.1:{stack.admin_port + i}/debug/state", 5, 0.02) for i in range(2)]
    tiny = [st["tenants"]["t-tiny"] for st in states]
    admitted = [st["ledger"]["precharged"] for st in states]
    # Both workers took streams (Envoy balanced them over the two endpoints) ...
    assert all(a > 0 for a in admitted), (admitted, tiny)
    assert all(st["store"]["member"].startswith(f"w-{i}#") for i, st in enumerate(states))
    # ... and together they kept one bucket: 20 requests of ~60 tokens need twice the
    # 600 tokens (each worker with its own bucket would have admitted all of them).
    assert codes.count(429) >= 5, codes
    assert sum(admitted) <= TINY_BURST + 10 * elapsed + 60, (admitted, elapsed)
    assert all(st["in_flight"] == 0 and st["ledger"]["balanced"] for st in states), states
    assert sum(t["rejections"].get("tpm", 0) for t in tiny) == codes.count(429)
    # every forwarded request settled in the worker that admitted it (its own sink)
    for i in range(2):
        text = stack.worker_metrics(i)
        assert "sluice_access_log_awaiting 0.0" in text
        assert 'sluice_access_log_entries_total{outcome="unknown"}' not in text
