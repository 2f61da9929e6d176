"""What Envoy refuses before it asks Sluice, as rendered from the policy (extproc.policy.edge,
extproc.envoy.edge); through the real Envoy in tests/e2e/test_hostile_requests.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.procs import envoy_binary
from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap, render_yaml
from extproc.envoy.edge import (
    CLIENT_INTERNAL,
    KEY_GUARD_ROUTE,
    KEY_LIMIT_FILTER,
    SOURCE_LIMIT_FILTER,
    STRIP_FILTER,
)
from extproc.policy.edge import EdgeLimits, edge_limits
from extproc.policy.model import DEFAULT_KEY_PATTERN
from extproc.policy.schema import PolicyError, build_policy, hash_key

BACKENDS = [BackendRoute("sim", "127.0.0.1", 8000)]


def doc(edge: dict[str, Any] | None = None, tenant_rpm: int | None = None) -> dict[str, Any]:
    tenant: dict[str, Any] = {"name": "a", "tier": "slow", "keys": [hash_key("sk-a")]}
    if tenant_rpm is not None:
        tenant["rpm"] = tenant_rpm
    return {
        "gateway": {"edge": edge} if edge is not None else {},
        "backends": [
            {"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 64}]}
        ],
        "tiers": {"slow": {"tpm": 10, "rpm": 60}, "fast": {"tpm": 10, "rpm": 1200}},
        "tenants": [tenant],
    }


def hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_each_key_is_held_to_the_fastest_rate_any_tier_or_tenant_may_go() -> None:
    assert edge_limits(build_policy(doc())) == EdgeLimits(DEFAULT_KEY_PATTERN, 20, 1220, 0, 0)
    assert (
        edge_limits(build_policy(doc(tenant_rpm=6000))).key_per_s == 100
    )  # a tenant's own rpm counts too
    assert edge_limits(build_policy(doc({"per_key": False}))).key_per_s == 0
    e = edge_limits(build_policy(doc({"source_rps": 2.5})))
    assert (e.source_per_s, e.source_burst) == (3, 6)
    assert edge_limits(build_policy(doc({"source_rps": 10, "source_burst": 50}))).source_burst == 50


def test_bad_edge_settings_fail_at_load() -> None:
    with pytest.raises(PolicyError, match="key_pattern"):
        build_policy(doc({"key_pattern": "sk-(unclosed"}))
    with pytest.raises(PolicyError, match="source_burst"):
        build_policy(doc({"source_burst": 5}))
    with pytest.raises(PolicyError, match="unknown field"):
        build_policy(doc({"per_tenant": True}))


def test_the_default_key_pattern_takes_real_keys_and_refuses_joined_or_spaced_ones() -> None:
    for key in ("sk-proj-Ab_9-xYz", "sk-sluice-" + "a" * 43, "sk-test-premium", "k"):
        assert re.fullmatch(DEFAULT_KEY_PATTERN, key), key
    for key in ("a,b", "two words", "", "sk-<script>"):
        assert not re.fullmatch(DEFAULT_KEY_PATTERN, key), key


def test_the_header_strip_comes_first_and_the_limiters_only_when_the_policy_has_them() -> None:
    names = [f["name"] for f in hcm(render_bootstrap(BACKENDS, EnvoyOptions()))["http_filters"]]
    assert (
        names[0] == STRIP_FILTER
        and KEY_LIMIT_FILTER not in names
        and SOURCE_LIMIT_FILTER not in names
    )
    both = EnvoyOptions(edge=EdgeLimits(key_per_s=5, key_burst=10, source_per_s=3, source_burst=6))
    m = hcm(render_bootstrap(BACKENDS, both))
    names = [f["name"] for f in m["http_filters"]]
    assert (
        names[:3] == [STRIP_FILTER, KEY_LIMIT_FILTER, SOURCE_LIMIT_FILTER]
        and names[3] == "envoy.filters.http.ext_proc"
    )
    strip = m["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert strip[0] == {"remove_on_match": {"key_matcher": {"prefix": "x-sluice-"}}}
    assert [s["remove"] for s in strip[1:]] == list(CLIENT_INTERNAL)
    guard = m["route_config"]["virtual_hosts"][0]["routes"][0]
    assert guard["name"] == KEY_GUARD_ROUTE and guard["direct_response"]["status"] == 401
    # Off on the guard (its 401 is cheaper than the limiter): only filters the listener has.
    assert set(guard["typed_per_filter_config"]) == {
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.lua",
        KEY_LIMIT_FILTER,
        SOURCE_LIMIT_FILTER,
    }


def test_envoy_accepts_the_edge(tmp_path: Path) -> None:
    opts = EnvoyOptions(edge=EdgeLimits(key_per_s=5, key_burst=10, source_per_s=3, source_burst=6))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(BACKENDS, opts))
    assert yaml.safe_load(path.read_text())
    done = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
