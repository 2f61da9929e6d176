"""``extproc serve --workers 2`` on a Redis store, behind one Envoy: one tenant, one budget.

Envoy opens a new ext_proc connection per stream here (``max_requests_per_connection:
1`` on the ext_proc cluster), so the kernel's ``SO_REUSEPORT`` spreads the streams over
both workers; the tenant's TPM bucket, kept in Redis, holds across them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
import yaml

from bench.procs import Proc, wait_http, wait_idle
from bench.redis_server import RedisServer
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, policy_options, write_config
from extproc.policy.schema import build_policy
from tests.e2e.harness import Stack, envoy_binary, running
from tests.e2e.test_datapath import auth, chat_body, post

pytestmark = pytest.mark.e2e

TINY_BURST = 600  # the tiny tier's bucket (tests/e2e/harness.py: test_policy), refilled at 10 tokens/s


class WorkersStack(Stack):
    """The harness's stack with ``--workers 2`` and one ext_proc connection per stream."""

    def start_extproc(self) -> None:
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy",
                             str(self.policy_dir), "--grpc", f"127.0.0.1:{self.grpc_port}",
                             "--admin", f"127.0.0.1:{self.admin_port}", "--replica-id", "w",
                             "--reload-interval", "0.2"], self.workdir / "extproc.log")
        self.procs["extproc"] = p.start()
        for i in range(2):
            wait_http(f"http://127.0.0.1:{self.admin_port + i}/healthz", proc=p.popen)

    def start_envoy(self) -> None:
        assert self.policy_doc is not None
        policy = build_policy(self.policy_doc)
        opts = EnvoyOptions(listen_port=self.envoy_port, admin_port=self.envoy_admin_port,
                            extproc_port=self.grpc_port, drain_port=self.admin_port,
                            **policy_options(policy))  # type: ignore[arg-type]
        cfg = write_config(self.workdir / "envoy.yaml", [BackendRoute("sim", "127.0.0.1", self.sim_port)], opts)
        doc = yaml.safe_load(cfg.read_text())
        for c in doc["static_resources"]["clusters"]:
            if c["name"] == "sluice_extproc":
                proto = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                proto["common_http_protocol_options"] = {"max_requests_per_connection": 1}
        cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                           "--concurrency", "1"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkersStack]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()  # Debian's redis-server
    try:
        s = WorkersStack(tmp_path_factory.mktemp("workers"), gateway={"state": redis.url})
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
    # Both workers took streams (SO_REUSEPORT spread Envoy's connections over them) ...
    assert all(a > 0 for a in admitted), (admitted, tiny)
    assert all(st["store"]["member"].startswith(f"w-{i}#") for i, st in enumerate(states))
    # ... and together they kept one bucket: 20 requests of ~60 tokens need twice the
    # 600 tokens (each worker with its own bucket would have admitted all of them).
    assert codes.count(429) >= 5, codes
    assert sum(admitted) <= TINY_BURST + 10 * elapsed + 60, (admitted, elapsed)
    assert all(st["in_flight"] == 0 and st["ledger"]["balanced"] for st in states), states
    assert sum(t["rejections"].get("tpm", 0) for t in tiny) == codes.count(429)
