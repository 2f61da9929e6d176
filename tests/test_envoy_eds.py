"""The pools' endpoint files for Envoy's EDS clusters (extproc/envoy/eds.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from extproc.__main__ import main
from extproc.backends.state import BackendState
from extproc.envoy.eds import (
    EdsWriter,
    destinations,
    policy_destinations,
    render,
    write_if_changed,
    write_policy,
)
from extproc.policy.schema import build_policy

CLA = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def pool_doc(*addresses: str) -> dict[str, Any]:
    return {
        "backends": [
            {"name": "pool", "max_concurrency": 8,
             "endpoints": [{"address": a, "kv_capacity_tokens": 1000} for a in addresses],
             "models": [{"name": "m", "context_window": 4096}]},
            {"name": "single", "address": "127.0.0.1:9000", "max_concurrency": 4,
             "models": [{"name": "n", "context_window": 4096}]},
        ],
        "tiers": {"t": {"priority": 1, "tpm": 1000, "rpm": 10}},
        "tenants": [],
    }


def hosts(text: str) -> list[tuple[str, int]]:
    (cla,) = yaml.safe_load(text)["resources"]
    assert cla["@type"] == CLA and cla["cluster_name"] == "pool"
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for loc in cla.get("endpoints", [])
        for e in loc["lb_endpoints"]
    ]


def test_a_discovery_response_with_one_load_assignment() -> None:
    text = render("pool", ["10.0.0.1:8000", "10.0.0.2:8001"])
    assert hosts(text) == [("10.0.0.1", 8000), ("10.0.0.2", 8001)]
    assert hosts(render("pool", [])) == []
    assert yaml.safe_load(render("pool", []))["resources"][0].get("endpoints", []) == []


def test_names_are_resolved_and_unresolvable_ones_left_out() -> None:
    policy = build_policy(pool_doc("localhost:8000", "127.0.0.1:8001", "no-such-host.invalid:8002"))
    assert policy_destinations(policy.backends[0]) == ("127.0.0.1:8000", "127.0.0.1:8001")


def test_replaced_atomically_and_only_when_the_content_changes(tmp_path: Path) -> None:
    path = tmp_path / "pool.eds.yaml"
    assert write_if_changed(path, "one\n")
    first = path.stat()
    assert oct(first.st_mode & 0o777) == "0o644"  # Envoy may run as another user
    assert not write_if_changed(path, "one\n")
    assert path.stat().st_ino == first.st_ino and path.stat().st_mtime_ns == first.st_mtime_ns
    assert write_if_changed(path, "two\n")
    # a new file moved over the old one (what Envoy's watched_directory sees), no leftovers
    assert path.stat().st_ino != first.st_ino and path.read_text() == "two\n"
    assert os.listdir(tmp_path) == ["pool.eds.yaml"]


def test_the_renderer_writes_the_first_files_from_the_policy(tmp_path: Path) -> None:
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(yaml.safe_dump(pool_doc("localhost:8000", "127.0.0.1:8001")))
    assert write_policy(tmp_path / "a", build_policy(pool_doc("127.0.0.1:8001"))) == [tmp_path / "a" / "pool.eds.yaml"]
    out = tmp_path / "envoy" / "envoy.yaml"
    assert main(["envoy-config", str(policy_dir), "-o", str(out)]) == 0
    assert sorted(os.listdir(out.parent)) == ["envoy.yaml", "pool.eds.yaml"]  # a single backend has none
    assert hosts((out.parent / "pool.eds.yaml").read_text()) == [("127.0.0.1", 8000), ("127.0.0.1", 8001)]
    assert main(["envoy-config", str(policy_dir), "-o", str(out), "--eds-dir", str(tmp_path / "eds")]) == 0
    assert hosts((tmp_path / "eds" / "pool.eds.yaml").read_text()) == [("127.0.0.1", 8000), ("127.0.0.1", 8001)]
    assert f"path: {tmp_path}/eds/pool.eds.yaml" in out.read_text()
    assert main(["envoy-config", str(policy_dir), "-o", str(out), "--eds-dir", str(tmp_path / "none"),
                 "--no-eds-files"]) == 0
    assert not (tmp_path / "none").exists()


def test_the_writer_follows_the_endpoint_sets_and_keeps_draining_ones(tmp_path: Path) -> None:
    doc = pool_doc("127.0.0.1:8000", "127.0.0.1:8001")
    policy = build_policy(doc)
    be = BackendState.create(policy.backends[0], policy, 0.0)
    backends = {"pool": be, "single": BackendState.create(policy.backends[1], policy, 0.0)}
    writer = EdsWriter(tmp_path / "eds")
    assert writer.sync(backends) == ["pool"]
    path = tmp_path / "eds" / "pool.eds.yaml"
    assert hosts(path.read_text()) == [("127.0.0.1", 8000), ("127.0.0.1", 8001)]
    assert writer.sync(backends) == [] and writer.writes == 1
    assert sorted(os.listdir(tmp_path / "eds")) == ["pool.eds.yaml"]

    # One request in flight on :8001, which then leaves the policy: it drains, still in the set.
    assert be.endpoints is not None
    placed = be.endpoints.place(10, 0.0, exclude=("127.0.0.1:8000",))
    assert placed is not None and placed.key == "127.0.0.1:8001"
    smaller = build_policy(pool_doc("127.0.0.1:8000", "localhost:8002"))
    be.reconfigure(smaller.backends[0], smaller, 1.0)
    assert writer.sync(backends) == ["pool"]
    assert hosts(path.read_text()) == [("127.0.0.1", 8000), ("127.0.0.1", 8001), ("127.0.0.1", 8002)]
    be.endpoints.release("127.0.0.1:8001", 10)  # its last request: forgotten, and out of the set
    assert destinations(be.endpoints) == ("127.0.0.1:8000", "127.0.0.1:8002")
    assert writer.sync(backends) == ["pool"]
    assert hosts(path.read_text()) == [("127.0.0.1", 8000), ("127.0.0.1", 8002)]


def test_an_endpoint_whose_name_resolves_later_joins_the_set(tmp_path: Path) -> None:
    policy = build_policy(pool_doc("127.0.0.1:8000", "not-yet.invalid:8001"))
    be = BackendState.create(policy.backends[0], policy, 0.0)
    writer = EdsWriter(tmp_path)
    writer.sync({"pool": be})
    assert hosts((tmp_path / "pool.eds.yaml").read_text()) == [("127.0.0.1", 8000)]
    assert be.endpoints is not None
    be.endpoints.by_key["not-yet.invalid:8001"].ip = "10.1.2.3"  # what monitor.resolve_later sets
    assert writer.sync({"pool": be}) == ["pool"]
    assert hosts((tmp_path / "pool.eds.yaml").read_text()) == [("10.1.2.3", 8001), ("127.0.0.1", 8000)]
