"""A client cannot make Envoy retry (a failed generation replayed, billed once), through the real Envoy.

Envoy's router honours x-envoy-retry-on, x-envoy-max-retries and their kin: a tenant that
could send them would have a failed generation replayed (run twice, billed once) or its
per-try timeout cut. Envoy strips client-sent x-envoy-* headers at the edge
(use_remote_address, no address internal) and Sluice removes the retry headers itself
(extproc.envoy.headers.CLIENT_RETRY_HEADERS). Checked on a single-address backend, a pool, and a
pass-through path: the backend answers 503 (or 404 asked to be retried), and it must see
the request exactly once, without the headers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"

# Every header that would make the router retry, hedge, or cut a try short, if it got there.
HOSTILE = {
    "x-envoy-retry-on": "5xx,gateway-error,reset,connect-failure,retriable-status-codes,retriable-4xx",
    "x-envoy-max-retries": "3",
    "x-envoy-retry-grpc-on": "unavailable,internal",
    "x-envoy-retriable-status-codes": "404,503",
    "x-envoy-hedge-on-per-try-timeout": "true",
    "x-envoy-upstream-rq-per-try-timeout-ms": "1",
    "x-envoy-upstream-rq-timeout-ms": "1",
}


@pytest.fixture(scope="module", params=["single", "pool", "pool_streamed"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    processing = "streamed" if request.param.endswith("streamed") else "usage_trailers"
    s = Stack(tmp_path_factory.mktemp(f"retry-{request.param}"),
              gateway={"unknown_paths": "passthrough", "response_processing": processing})
    assert s.policy_doc is not None
    be = s.policy_doc["backends"][0]
    be["breaker"] = {"consecutive_failures": 1000, "min_requests": 1000}  # 503s on purpose: stay closed
    if request.param.startswith("pool"):
        del be["address"], be["metrics_url"]
        be["endpoints"] = [{"address": f"127.0.0.1:{s.sim_port}", "kv_capacity_tokens": 100_000}]
    with running(s) as started:
        yield started


def send(stack: Stack, path: str, marker: str) -> httpx.Response:
    body = {"model": "sim-llama-8b", "messages": [{"role": "user", "content": marker}], "max_tokens": 4}
    return httpx.post(stack.url + path, content=json.dumps(body).encode(), timeout=20, headers={
        "authorization": f"Bearer {TEST_KEYS['premium']}", "content-type": "application/json",
        "x-sim-status": "503" if path == CHAT else "404", **HOSTILE})


def seen(stack: Stack, path: str, marker: str) -> list[dict[str, Any]]:
    return [r for r in stack.sim_requests() if r["path"] == path and isinstance(r.get("json"), dict)
            and r["json"].get("messages", [{}])[0].get("content") == marker]


@pytest.mark.parametrize("path", [CHAT, "/v1/not-an-openai-path"])
def test_a_clients_retry_headers_never_reach_the_router(stack: Stack, path: str) -> None:
    marker = f"retry me {path}"
    r = send(stack, path, marker)
    # The backend's own answer: not a 504 from a 1 ms (per-try) timeout, not a retried one.
    assert r.status_code == (503 if path == CHAT else 404), r.text
    (once,) = seen(stack, path, marker)
    assert not set(HOSTILE) & set(once["headers"]), once["headers"]


def test_envoy_took_every_header_mutation_sluice_made(stack: Stack) -> None:
    """The removals above and the pool's x-envoy-max-retries: 0 pass Envoy's mutation rules
    (a refused one would be ignored silently, and counted here)."""
    send(stack, CHAT, "mutations counted")
    stats = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats",
                      params={"filter": "ext_proc.*rejected_header_mutations"}, timeout=5).text
    counts = [line.rsplit(":", 1) for line in stats.splitlines() if line.strip()]
    assert counts, stats
    assert all(int(v) == 0 for _, v in counts), stats


def test_a_pool_request_served_by_its_pick_is_no_repick(stack: Stack) -> None:
    """Envoy's upstream.address (extproc.envoy.headers.UPSTREAM_ATTRIBUTE) names the pick in the form
    Sluice compares it with, under both response modes: nothing moves, nothing is counted."""
    body = {"model": "sim-llama-8b", "messages": [{"role": "user", "content": "served by the pick"}],
            "max_tokens": 4, "stream": True}
    r = httpx.post(stack.url + CHAT, json=body, timeout=20,
                   headers={"authorization": f"Bearer {TEST_KEYS['premium']}"})
    assert r.status_code == 200, r.text
    assert "x-sluice-upstream" not in r.headers
    stack.wait_settled()
    assert "sluice_endpoint_repicks_total{" not in stack.metrics_text()
    pools = [b for b in stack.state()["backends"].values() if b.get("endpoints")]
    assert len(pools) == (0 if stack.policy_doc and "address" in stack.policy_doc["backends"][0] else 1)
    for b in pools:
        assert all(e["repicks"] == {"away": 0, "here": 0} for e in b["endpoints"]), b["endpoints"]
