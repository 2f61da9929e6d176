"""Sluice inside an Envoy config that is not its own: ``envoy-config --pieces`` merged, as
docs/deploying.md says, into a config with its own listener, routes (a health route Sluice
must not see), an RBAC filter in front, and its own cluster for the model server."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.harness import TEST_KEYS, Proc, Stack, envoy_binary, eventually, running, wait_http

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
PREMIUM = {"authorization": f"Bearer {TEST_KEYS['premium']}"}
HPO = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def foreign(listen: int, admin: int, backend: int) -> dict[str, Any]:
    """Someone's Envoy: a public listener, an RBAC filter, a health route, a route to their model server."""
    rbac = {"name": "envoy.filters.http.rbac", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": {"blocked-clients": {
            "permissions": [{"any": True}],
            "principals": [{"header": {"name": "x-blocked", "present_match": True}}]}}}}}
    router = {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "public", "address": {"socket_address": {"address": "127.0.0.1",
                                                                            "port_value": listen}},
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": {
                                   "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                            "http_connection_manager.v3.HttpConnectionManager",
                                   "stat_prefix": "public",
                                   "route_config": {"name": "public", "virtual_hosts": [{
                                       "name": "api", "domains": ["*"], "routes": [
                                           {"name": "health", "match": {"path": "/healthz"},
                                            "direct_response": {"status": 200, "body": {"inline_string": "ok"}}},
                                           {"name": "models", "match": {"prefix": "/"},
                                            "route": {"cluster": "llm", "timeout": "0s"}}]}]},
                                   "http_filters": [rbac, router]}}]}]}],
            "clusters": [{"name": "llm", "type": "STATIC", "connect_timeout": "2s",
                          "load_assignment": {"cluster_name": "llm", "endpoints": [{"lb_endpoints": [{"endpoint": {
                              "address": {"socket_address": {"address": "127.0.0.1", "port_value": backend}}}}]}]}}],
        },
    }


def merge(cfg: dict[str, Any], pieces: dict[str, Any], backend_cluster: str) -> dict[str, Any]:
    """What docs/deploying.md tells a user to do with the pieces."""
    out = copy.deepcopy(cfg)
    res = out["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    router = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "envoy.filters.http.router")
    hcm["http_filters"][router:router] = pieces["http_filters"]
    hcm.setdefault("access_log", []).extend(pieces.get("access_log", []))  # response_processing access_log
    res["clusters"].extend(pieces["clusters"])
    off = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if "direct_response" in route:  # the health route: not admitted
            route["typed_per_filter_config"] = {f["name"]: off for f in pieces["http_filters"]}
        else:
            route["response_headers_to_add"] = pieces["response_headers_to_add"]
    cluster = next(c for c in res["clusters"] if c["name"] == backend_cluster)
    cluster["typed_extension_protocol_options"] = {HPO: {
        "@type": f"type.googleapis.com/{HPO}", "explicit_http_config": {"http_protocol_options": {}},
        "http_filters": pieces["upstream_http_filters"]}}
    return out


class OwnEnvoy(Stack):
    def start_envoy(self) -> None:
        pieces_path = self.workdir / "pieces.yaml"
        subprocess.run([sys.executable, "-m", "extproc", "envoy-config", str(self.policy_dir), "--pieces",
                        "-o", str(pieces_path), "--extproc", f"127.0.0.1:{self.grpc_port}", "--no-eds-files"],
                       check=True, capture_output=True)
        pieces = yaml.safe_load(pieces_path.read_text())
        cfg = self.workdir / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(merge(foreign(self.envoy_port, self.envoy_admin_port, self.sim_port),
                                            pieces, "llm")))
        p = Proc("envoy", [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "-l", "warning",
                            "--concurrency", "1"], self.workdir / "envoy.log")
        self.procs["envoy"] = p.start()
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", proc=p.popen)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnEnvoy]:
    s = OwnEnvoy(tmp_path_factory.mktemp("own-envoy"))
    with running(s):
        yield s


def requests_seen(s: OwnEnvoy) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in s.metrics_text().splitlines()
               if line.startswith("sluice_requests_total{"))


def test_the_health_route_and_the_rbac_filter_are_theirs(stack: OwnEnvoy) -> None:
    seen = requests_seen(stack)
    assert httpx.get(stack.url + "/healthz", timeout=10).text == "ok"  # no key, no Sluice
    r = httpx.post(stack.url + CHAT, headers={**PREMIUM, "x-blocked": "1"}, json={}, timeout=10)
    assert r.status_code == 403  # their RBAC said no before Sluice was asked
    assert requests_seen(stack) == seen


def test_sluice_admits_and_settles_exactly_there(stack: OwnEnvoy) -> None:
    assert httpx.post(stack.url + CHAT, json={"model": "sim-llama-8b"}, timeout=10).headers["x-sluice-reason"] == \
        "unknown_key"
    before = stack.state()["ledger"]
    body = {"model": "sim-llama-8b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20,
            "stream": True}
    with httpx.stream("POST", stack.url + CHAT, headers=PREMIUM, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-tokens"] == "1000000"  # from Sluice's metadata, on their route
        raw = "".join(r.iter_text())
    events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    assert events and not any(e.get("usage") for e in events)  # the usage chunk Sluice asked for, hidden
    stack.wait_settled()
    sim = [q for q in stack.sim_requests() if q["path"] == CHAT][-1]
    assert sim["json"]["stream_options"] == {"include_usage": True}
    after = eventually(lambda: (a := stack.state()["ledger"])["charged"] > before["charged"] and a, 5,
                       "the stream settled")
    charged = after["charged"] - before["charged"]
    assert 20 < charged < 20 + 40  # the prompt and the 20 generated, not the reservation
    tiny = {"authorization": f"Bearer {TEST_KEYS['tiny']}"}
    big = {**body, "stream": False, "max_tokens": 500}
    assert httpx.post(stack.url + CHAT, headers=tiny, json=big, timeout=30).status_code == 200
    r = httpx.post(stack.url + CHAT, headers=tiny, json=big, timeout=30)
    assert r.status_code == 429 and r.headers["x-sluice-reason"].startswith("tpm")


def test_the_pieces_are_cut_from_sluices_own_bootstrap(stack: OwnEnvoy) -> None:
    pieces = yaml.safe_load((stack.workdir / "pieces.yaml").read_text())
    own = yaml.safe_load((Path(stack.workdir) / "envoy.yaml").read_text())
    names = [f["name"] for f in pieces["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.lua"]
    assert [c["name"] for c in pieces["clusters"]] == ["sluice_extproc"]
    assert own["static_resources"]["clusters"][-1]["name"] == "sluice_extproc"
