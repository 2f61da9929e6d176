"""What a hostile client tried and must not get, through the real Envoy: headers that reach
the backend as if Sluice or a gateway had set them, a key header sent twice, a body label
that disagrees with the body Sluice read, an error body swallowed by the usage filter,
and refusals that cost Sluice a round trip each (answered by Envoy instead)."""

from __future__ import annotations

import gzip
import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import harness
from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
SOURCE_BURST = 24
# Read by Sluice, a gateway or a mesh to route or trust a request (extproc.envoy.edge).
FORGED = {
    "x-real-ip": "10.9.9.9",
    "forwarded": "for=10.9.9.9",
    "x-gateway-destination-endpoint": "10.9.9.9:80",
    "x-gateway-destination-endpoint-subset": "10.9.9.9:80",
    "x-envoy-peer-metadata": "Zm9v",
    "x-sluice-admitted": "1",
    "x-sluice-reason": "forged",
    "x-sluice-hide-usage": "1",
    "x-sluice-tenant": "t-premium",
    "x-sluice-tier": "premium",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(
        Stack(tmp_path_factory.mktemp("hostile"), gateway={"unknown_paths": "passthrough"})
    ) as s:
        yield s


def auth(tier: str = "tiny") -> dict[str, str]:
    return {"authorization": f"Bearer {TEST_KEYS[tier]}"}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def rejections(stack: Stack, reason: str) -> float:
    return stack.metric_sum("sluice_rejections_total", reason=reason)


def raw_post(
    stack: Stack, headers: list[tuple[str, str]], body: bytes, path: str = CHAT
) -> tuple[int, dict, bytes]:
    """A POST with repeated headers kept as sent (httpx would merge them)."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=10)
    try:
        conn.putrequest("POST", path)
        for k, v in [
            *headers,
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]:
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", [CHAT, "/v1/files"], ids=["admitted", "passthrough"])
def test_headers_sluice_or_a_gateway_reads_never_reach_the_backend_from_a_client(
    stack: Stack, path: str
) -> None:
    stack.clear_sim_requests()
    body = chat() if path == CHAT else {"purpose": "x"}
    r = httpx.post(stack.url + path, json=body, headers={**auth(), **FORGED}, timeout=10)
    assert r.status_code in (200, 404), r.text  # the sim has no /v1/files: its 404 passed through
    (seen,) = [q for q in stack.sim_requests() if q["path"] == path]
    got = seen["headers"]
    for name in (
        "x-real-ip",
        "forwarded",
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-subset",
        "x-envoy-peer-metadata",
        "x-sluice-admitted",
        "x-sluice-reason",
        "x-sluice-hide-usage",
    ):
        assert name not in got, (name, got)
    # What Sluice itself sets is what it means: the key's tenant, not the client's claim.
    assert got["x-sluice-tenant"] == "t-tiny" and got["x-sluice-tier"] == "tiny"


@pytest.mark.parametrize("header", ["x-api-key", "authorization"])
def test_a_key_header_sent_twice_is_refused(stack: Stack, header: str) -> None:
    value = (lambda k: k) if header == "x-api-key" else (lambda k: f"Bearer {k}")
    status, headers, body = raw_post(
        stack,
        [(header, value(TEST_KEYS["other"])), (header, value(TEST_KEYS["premium"]))],
        json.dumps(chat()).encode(),
    )
    assert status == 401 and headers["x-sluice-reason"] == "unknown_key", body
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer"},
        {"authorization": "Basic dXNlcjpwYXNz"},
        {"x-api-key": "has space in it"},
        {"authorization": "Bearer sk-<script>"},
    ],
    ids=["none", "empty", "basic", "spaces", "junk"],
)
def test_envoy_answers_a_request_without_a_well_formed_key_itself(
    stack: Stack, headers: dict[str, str]
) -> None:
    """A 401 without a round trip to Python: extproc never counts it."""
    before = rejections(stack, "unknown_key")
    r = httpx.post(stack.url + CHAT, json=chat(), headers=headers, timeout=10)
    assert r.status_code == 401 and r.headers["x-sluice-reason"] == "unknown_key"
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert rejections(stack, "unknown_key") == before
    # A well-formed key Sluice does not know still gets Sluice's 401 (it needs the policy).
    r = httpx.post(
        stack.url + CHAT, json=chat(), headers={"authorization": "Bearer sk-well-formed-unknown"}
    )
    assert r.status_code == 401 and rejections(stack, "unknown_key") == before + 1


def test_a_body_in_an_encoding_sluice_did_not_decode_is_refused_not_forwarded(stack: Stack) -> None:
    """Plain JSON labelled gzip reached the engine, which answered 500 (and opened breakers)."""
    stack.clear_sim_requests()
    raw = json.dumps(chat()).encode()
    for encoding, body in (("gzip", raw), ("gzip", gzip.compress(raw)), ("br", raw)):
        status, headers, out = raw_post(
            stack, [*auth().items(), ("content-encoding", encoding)], body
        )
        assert status == 415, out
        assert headers["x-sluice-reason"] == "unsupported_encoding"
        assert json.loads(out)["error"]["type"] == "invalid_request_error"
    status, _, _ = raw_post(stack, [*auth().items(), ("content-encoding", "identity")], raw)
    assert status == 200
    assert len([q for q in stack.sim_requests() if q["path"] == CHAT]) == 1


def test_a_streaming_request_the_backend_refuses_gets_the_backends_error_body(stack: Stack) -> None:
    """The usage-hiding filter held a JSON error body back as an unfinished event: the client
    got content-length 0 and the openai SDK an error without a message."""
    r = httpx.post(
        stack.url + CHAT,
        json=chat(stream=True),
        headers={**auth(), "x-sim-status": "400"},
        timeout=10,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "simulated_failure" and "x-sim-status" in err["message"]


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Every tier at 6 requests a minute: Envoy holds each key to 1/s with a burst of 7,
    and (source_rps) each client address to 1/s with a burst of SOURCE_BURST."""
    stack = Stack(tmp_path_factory.mktemp("limited"))
    doc = harness.test_policy(stack.sim_port, edge={"source_rps": 1, "source_burst": SOURCE_BURST})
    for tier in doc["tiers"].values():
        tier["rpm"] = 6
    stack.policy_doc = doc
    with running(stack) as s:
        yield s


def test_a_key_faster_than_any_tier_allows_is_refused_by_envoy(limited: Stack) -> None:
    key = {"authorization": f"Bearer {TEST_KEYS['premium']}"}
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as client:
        got = [client.post(limited.url + CHAT, json=chat(), headers=key) for _ in range(16)]
    elapsed = time.monotonic() - t0
    codes = [(r.status_code, r.headers.get("x-sluice-reason")) for r in got]
    assert codes[:6] == [(200, None)] * 6, codes
    assert codes[6] == (429, "rpm"), codes  # Sluice's own bucket: the 7th in the minute
    # Envoy lets 7 through at once and one more a second: the rest never reach Sluice.
    reached = sum(1 for c in codes if c[1] != "edge_rate_limited")
    assert reached <= 7 + int(elapsed) + 1, (codes, elapsed)
    edge = [r for r in got if r.headers.get("x-sluice-reason") == "edge_rate_limited"]
    assert edge and all(r.status_code == 429 and r.headers["retry-after"] == "1" for r in edge)
    assert edge[0].json()["error"]["code"] == "edge_rate_limited"
    # Another key from the same address still reaches Sluice (the address allows 10).
    r = httpx.post(
        limited.url + CHAT, json=chat(), headers={"authorization": f"Bearer {TEST_KEYS['free']}"}
    )
    assert r.status_code == 200


def test_a_flood_of_made_up_keys_from_one_address_is_held_by_the_address_limit(
    limited: Stack,
) -> None:
    """A new key each request defeats the per-key buckets; the address's holds them all."""
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as client:
        got = [
            client.post(
                limited.url + CHAT,
                json=chat(),
                headers={"authorization": f"Bearer sk-made-up-{i:04d}"},
            )
            for i in range(3 * SOURCE_BURST)
        ]
    elapsed = time.monotonic() - t0
    reasons = [r.headers.get("x-sluice-reason") for r in got]
    assert set(reasons) <= {"unknown_key", "edge_rate_limited"}, reasons
    # At most the burst and one a second reached Sluice (less what the test before used).
    assert reasons.count("unknown_key") <= SOURCE_BURST + int(elapsed) + 1, (reasons, elapsed)
    assert "edge_rate_limited" in reasons, (reasons, elapsed)
