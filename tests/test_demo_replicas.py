"""``make demo REPLICAS=3``: the Envoy config balances ext_proc over the replicas; redis-server installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from bench.demo import ADMIN_PORT, GRPC_PORT, REDIS_PORT
from bench.procs import ROOT, envoy_binary
from extproc.__main__ import main


def test_the_ext_proc_cluster_gets_one_endpoint_per_replica(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    grpc = ",".join(f"127.0.0.1:{GRPC_PORT + i}" for i in range(3))
    assert main(["envoy-config", str(ROOT / "policies"), "-o", str(out), "--extproc", grpc]) == 0
    doc = yaml.safe_load(out.read_text())
    (ext,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "sluice_extproc"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in ext["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [50051, 50052, 50053]
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_demo_ports_and_what_make_installs() -> None:
    assert (GRPC_PORT, ADMIN_PORT, REDIS_PORT) == (50051, 9100, 6380)  # as the README says
    one = subprocess.run(["make", "-n", "demo"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    three = subprocess.run(["make", "-n", "demo", "REPLICAS=3"], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout
    assert "redis-server" not in one and "--replicas 1" in one
    assert "system_packages.sh redis-server" in three and "--replicas 3" in three


def test_make_bench_installs_redis_and_runs_the_state_store_part() -> None:
    from bench.run import PARTS

    bench = subprocess.run(["make", "-n", "bench"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "system_packages.sh redis-server" in bench and "bench.run" in bench
    assert "state_store" in PARTS
