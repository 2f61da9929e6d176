"""Reading a rendered Envoy bootstrap in tests: the parts a test looks at, and a backend set."""

from __future__ import annotations

from extproc.envoy.bootstrap import BackendRoute

BACKENDS = (
    BackendRoute("sim", "127.0.0.1", 8000, ("llama-3-8b",)),
    BackendRoute("big", "localhost", 8001),
)
HCM_TYPE = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ERROR_KEYS = {"message", "type", "param", "code"}


def hcm(config: dict) -> dict:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (network_filter,) = chain["filters"]
    assert network_filter["typed_config"]["@type"].endswith(HCM_TYPE)
    return network_filter["typed_config"]


def ext_proc(config: dict) -> dict:
    (f,) = [f for f in hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return f["typed_config"]


def clusters(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}

