"""The Envoy config side Sluice needs for the re-pick on a connect failure: what ext_proc may mutate,
and the served address as an attribute."""

from __future__ import annotations

import re

from extproc.envoy.bootstrap import BackendRoute, EnvoyOptions, render_bootstrap
from extproc.envoy.headers import CLIENT_RETRY_HEADERS, ENVOY_MUTABLE, UPSTREAM_ATTRIBUTE
from tests.envoy_config import ext_proc

ONE = (BackendRoute("sim", "127.0.0.1", 8000),)
POOL = (BackendRoute("sim", "127.0.0.1", 8000), BackendRoute("pool", "127.0.0.1", 1, pool=True))


def test_ext_proc_may_touch_the_routers_retry_headers_and_no_other_x_envoy_header() -> None:
    rules = ext_proc(render_bootstrap(ONE, EnvoyOptions()))["mutation_rules"]
    assert rules["allow_expression"]["regex"] == ENVOY_MUTABLE
    assert rules.get("allow_envoy", False) is False
    # Envoy matches the whole name (RE2 FullMatch), and refuses a program over 100.
    assert all(re.fullmatch(ENVOY_MUTABLE, h) for h in CLIENT_RETRY_HEADERS)
    for other in ("x-envoy-original-path", "x-envoy-internal", "x-envoy-expected-rq-timeout-ms",
                  "x-envoy-external-address", "x-envoy-decorator-operation", "x-sluice-backend"):
        assert not re.fullmatch(ENVOY_MUTABLE, other), other


def test_with_a_pool_envoy_sends_the_address_that_served_in_both_response_modes() -> None:
    trailers = ext_proc(render_bootstrap(POOL, EnvoyOptions()))
    assert trailers["response_attributes"] == [UPSTREAM_ATTRIBUTE]
    streamed = ext_proc(render_bootstrap(POOL, EnvoyOptions(response_processing="streamed")))
    assert streamed["response_attributes"] == ["response.code", UPSTREAM_ATTRIBUTE]
    # Without a pool nothing changes.
    assert "response_attributes" not in ext_proc(render_bootstrap(ONE, EnvoyOptions()))
    assert ext_proc(render_bootstrap(ONE, EnvoyOptions(response_processing="streamed")))["response_attributes"] \
        == ["response.code"]
