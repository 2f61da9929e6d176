"""``extproc serve --workers N``: refused without a shared store; with Redis, N workers on one port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from bench.procs import ROOT, free_port, free_ports, http_ok, tcp_open
from bench.redis_server import RedisServer
from extproc.policy.share import local_share
from extproc.policyfile import load_policy
from extproc.service.workers import refusal, worker_argv
from extproc.store import ENV_URL
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.waiting import eventually

POLICY = str(ROOT / "policies")


def _up(check: object, *args: object) -> bool:
    try:
        return bool(check(*args))  # type: ignore[operator]
    except OSError:
        return False


def test_more_than_one_worker_is_refused_with_the_reason() -> None:
    grpc_port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}  # the example policy: gateway.state memory
    done = subprocess.run([sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy", POLICY,
                           "--grpc", f"127.0.0.1:{grpc_port}", "--admin", f"127.0.0.1:{admin_port}"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--workers 2 refused" in done.stderr
    assert "per worker" in done.stderr and "shared state store" in done.stderr and ENV_URL in done.stderr
    assert not _up(tcp_open, grpc_port), "nothing may be listening after a refusal"


def test_the_refusal_lifts_only_with_shared_state() -> None:
    assert refusal(1, shared_state=False) is None
    assert refusal(4, shared_state=False) is not None
    assert refusal(4, shared_state=True) is None
    assert refusal(0, shared_state=True) == "--workers must be at least 1"


def test_each_worker_gets_one_worker_and_its_own_grpc_and_admin_ports() -> None:
    argv = ["serve", "--policy", "p", "--workers", "3", "--admin", "0.0.0.0:9100", "--grpc", "127.0.0.1:50051"]
    assert worker_argv(argv, 2, 9102) == ["serve", "--policy", "p", "--grpc", "127.0.0.1:50053", "--workers", "1",
                                          "--worker-index", "2", "--admin", "0.0.0.0:9102"]
    assert worker_argv(["serve", "--workers=2"], 0, 9100)[-4:] == ["--worker-index", "0", "--admin", "127.0.0.1:9100"]
    assert worker_argv(["serve", "--workers=2"], 1, 9101)[:3] == ["serve", "--grpc", "127.0.0.1:50052"]
    assert worker_argv(argv, 1, 9101, 3)[-6:] == ["--workers", "3", "--worker-index", "1", "--admin", "0.0.0.0:9101"]
    # the access-log sink key follows the port Envoy's config lists for the worker
    advertised = worker_argv([*argv, "--advertise", "extproc:50051"], 1, 9101, 3)
    assert advertised[advertised.index("--advertise") + 1] == "extproc:50052"


def test_each_worker_gets_floor_of_the_per_process_limits() -> None:
    policy = load_policy(POLICY)
    local = local_share(policy, 3)
    assert local_share(policy, 1) is policy
    for b, mine in zip(policy.backends, local.backends, strict=True):
        assert mine.max_concurrency == b.max_concurrency // 3
        assert mine.kv_capacity_tokens == (None if b.kv_capacity_tokens is None else b.kv_capacity_tokens // 3)
        assert local.by_model[b.models[0].name][0] is mine  # admission finds the cut backend by model
    for name, t in policy.tiers.items():
        mine = local.tiers[name]
        assert (mine.max_concurrency, mine.guaranteed_slots) == (t.max_concurrency // 3, t.guaranteed_slots // 3)
        assert (mine.tpm, mine.rpm, mine.max_queue_depth) == (t.tpm, t.rpm, t.max_queue_depth)  # shared or no capacity
    tenant = next(iter(local.tenants.values()))
    assert local.limits(tenant).max_concurrency == policy.limits(policy.tenants[tenant.name]).max_concurrency // 3
    assert policy.limits(policy.tenants[tenant.name]).max_concurrency > local.limits(tenant).max_concurrency


def _listeners(port: int) -> int:
    """Sockets listening on ``port`` (state 0A; grpc binds v4-mapped IPv6 sockets)."""
    rows = [r for t in ("tcp", "tcp6") for r in Path(f"/proc/net/{t}").read_text().splitlines()[1:]]
    return sum(1 for r in rows if r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A")


def _state(admin_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/debug/state", timeout=5) as r:
        return json.loads(r.read())


def test_workers_with_redis_each_serve_their_own_grpc_port_and_stop_together(redis_server: RedisServer) -> None:
    grpc_port, admin_port = free_ports(2), free_ports(2)
    parent = subprocess.Popen([sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy", POLICY,
                               "--grpc", f"127.0.0.1:{grpc_port}", "--admin", f"127.0.0.1:{admin_port}",
                               "--replica-id", "host-a"], cwd=ROOT, start_new_session=True,
                              env={**os.environ, ENV_URL: redis_server.url})
    try:
        def both_up() -> bool:
            assert parent.poll() is None, "the supervisor exited"
            return _up(http_ok, f"http://127.0.0.1:{admin_port}/healthz") \
                and _up(http_ok, f"http://127.0.0.1:{admin_port + 1}/healthz")

        eventually(both_up, 30, "the workers did not come up", interval=0.1)
        # One port each: Envoy multiplexes its streams over one connection per endpoint.
        assert (_listeners(grpc_port), _listeners(grpc_port + 1)) == (1, 1)
        full = load_policy(POLICY).backends[0]
        leased = []
        for i in range(2):
            st = _state(admin_port + i)
            assert st["store"]["kind"] == "redis" and st["store"]["member"].startswith(f"host-a-{i}#"), st["store"]
            # Each worker admits from its leases in Redis (extproc/store/slot_leases.py): one per endpoint of
            # the pool (extproc/runtime/leases.py), summed into the backend's slots.
            pools = st["store"]["slot_leases"]["pools"]
            mine = [pools[f"{full.name}@{e.key}"] for e in full.endpoints]
            assert [p["pool"] for p in mine] == [e.max_concurrency for e in full.endpoints], mine
            assert all(p["leased"] > 0 for p in mine), mine
            assert st["backends"][full.name]["slots"]["total"] == sum(p["leased"] for p in mine)
            leased.append(sum(p["leased"] for p in mine))
            assert st["tenants"]  # the policy's tenants, with the per-process caps cut to floor(cap / 2)
        assert sum(leased) <= full.max_concurrency, leased
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(15) == 0
        assert _listeners(grpc_port) == _listeners(grpc_port + 1) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
