"""The edge settings of the gateway policy, and the query-string credential redaction."""

from __future__ import annotations

import asyncio

import pytest

from extproc.openai_api.redact import CREDENTIAL_PARAMS, redact_query
from extproc.policy.schema import PolicyError, build_policy, hash_key
from extproc.runtime.runtime import Runtime
from tests.test_stream import exchange, headers


def doc(gateway: dict | None = None, queue_wait_ms: int = 0) -> dict:
    return {
        "gateway": gateway or {},
        "backends": [{"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 1000, "rpm": 10, "max_queue_wait_ms": queue_wait_ms}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    }


def test_edge_defaults() -> None:
    gw = build_policy(doc()).gateway
    assert (gw.drain_max_bytes, gw.drain_timeout_s) == (64 << 20, 30.0)
    assert (gw.request_headers_timeout_s, gw.request_timeout_s) == (10.0, 120.0)
    assert (gw.max_connections, gw.trusted_proxy_hops) == (1024, 0)


def test_edge_settings_are_read_and_checked() -> None:
    gw = build_policy(doc({"drain_max_bytes": 1 << 20, "drain_timeout_s": 5, "request_headers_timeout_s": 2.5,
                           "request_timeout_s": 30, "max_connections": 9, "trusted_proxy_hops": 1})).gateway
    assert (gw.drain_max_bytes, gw.drain_timeout_s, gw.request_headers_timeout_s) == (1 << 20, 5.0, 2.5)
    assert (gw.request_timeout_s, gw.max_connections, gw.trusted_proxy_hops) == (30.0, 9, 1)
    with pytest.raises(PolicyError) as exc:
        build_policy(doc({"max_connections": 0, "trusted_proxy_hops": -1, "drain_timeout_s": "x"}))
    text = str(exc.value)
    assert "max_connections" in text and "trusted_proxy_hops" in text and "drain_timeout_s" in text


def test_request_timeout_must_outlast_the_longest_queue_wait() -> None:
    # Envoy's request_timeout includes the time a request waits in Sluice's queue
    with pytest.raises(PolicyError) as exc:
        build_policy(doc({"request_timeout_s": 30}, queue_wait_ms=25_000))
    assert "request_timeout_s" in str(exc.value) and "35" in str(exc.value)
    assert build_policy(doc({"request_timeout_s": 35}, queue_wait_ms=25_000)).gateway.request_timeout_s == 35
    assert build_policy(doc({"request_timeout_s": 3})).gateway.request_timeout_s == 3  # no queueing tier


@pytest.mark.parametrize(("path", "clean"), [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/chat/completions?api_key=sk-1", "/v1/chat/completions"),
    ("/v1/x?a=1&API-KEY=sk&b=2&token=t&key", "/v1/x?a=1&b=2"),
    ("/v1/x?Access_Token=t&api%5Fkey=sk&keep=%20", "/v1/x?keep=%20"),
    ("/v1/x?apikey=1&&limit=5", "/v1/x?limit=5"),
    ("/v1/x?keyring=1&monkey=2", "/v1/x?keyring=1&monkey=2"),  # names, not substrings
    ("/v1/x?", "/v1/x"),
])
def test_redact_query(path: str, clean: str) -> None:
    assert redact_query(path) == clean


def test_the_documented_list() -> None:
    assert {"api_key", "api-key", "key", "access_token", "token"} <= CREDENTIAL_PARAMS


def _policy(unknown_paths: str = "reject"):  # noqa: ANN202
    return build_policy({**doc({"unknown_paths": unknown_paths}),
                         "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                                       "models": [{"name": "m", "context_window": 4096}]}]})


def _set_headers(resp) -> dict[str, bytes]:  # noqa: ANN001
    return {h.header.key: h.header.raw_value for h in resp.request_headers.response.header_mutation.set_headers}


@pytest.mark.parametrize("unknown_paths", ["reject", "passthrough"])
def test_stream_removes_query_keys_from_the_forwarded_path(unknown_paths: str) -> None:
    rt = Runtime(_policy(unknown_paths))
    path = "/v1/chat/completions" if unknown_paths == "reject" else "/v1/other"
    out = asyncio.run(exchange(rt, headers(_path=f"{path}?api_key=sk-secret&n=1", _method="POST",
                                           authorization="Bearer k", content_length="10")))
    assert _set_headers(out[0])[":path"] == f"{path}?n=1".encode()
    # a clean path is left alone: no mutation at all
    out = asyncio.run(exchange(rt, headers(_path=f"{path}?n=1", _method="POST", authorization="Bearer k",
                                           content_length="10")))
    assert ":path" not in _set_headers(out[0])
    rt.close()
