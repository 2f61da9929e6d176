"""Charged equals processed, through the real Envoy, for every way a request can end:
what Sluice charged each request is held against the simulated engine's own record of
what it did for it (tests/e2e/billing.py), under both response paths.

A client that hangs up, streaming or not, must stop the engine (Envoy resets the upstream
request and the engine aborts, as vLLM's server does) and pay for what the engine did
until then: before the fix a non-streaming request whose client left before the answer
paid its prompt alone however long the engine had generated.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.procs import get_json
from tests.e2e.billing import Billing
from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
PACE = 50  # tokens/s of every generating request here (x-sim-tps)
# From the client's close to the engine's abort: observed 2-10 ms on an idle machine; the
# bound leaves room for a loaded one.
ABORT_BOUND_S = 1.0


@pytest.fixture(scope="module", params=["usage_trailers", "streamed"])
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    mode = request.param
    with running(
        Stack(tmp_path_factory.mktemp(f"billing-{mode}"), gateway={"response_processing": mode})
    ) as s:
        yield s


def auth(tier: str = "premium") -> dict[str, str]:
    return {"authorization": f"Bearer {TEST_KEYS[tier]}"}


def chat(max_tokens: int = 64, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-llama-8b",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "tell me a long story about tokens"}],
        **extra,
    }


def post(
    stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        stack.url + path, json=body, headers={**auth(), **(headers or {})}, timeout=30
    )


def learn_rate(stack: Stack) -> None:
    """One stream that reports its usage teaches Sluice the model's decode rate (PACE)."""
    r = post(
        stack,
        CHAT,
        chat(100, stream=True, stream_options={"include_usage": True}),
        {"x-sim-tps": str(PACE), "x-sim-tokens": "100"},
    )
    assert r.status_code == 200 and '"usage":{' in r.text
    stack.wait_settled()


def cut(stack: Stack, body: dict[str, Any], after_s: float) -> tuple[bytes, float]:
    """Send ``body`` on a raw connection, read for ``after_s`` seconds, hang up; returns what
    was received and when the connection was closed."""
    raw = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TEST_KEYS['premium']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\nx-sim-tps: {PACE}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", stack.envoy_port))
    sock.sendall(head + raw)
    got, end = b"", time.monotonic() + after_s
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    sock.close()
    return got, time.monotonic()


def engine_abort_after(stack: Stack, mark: int, closed_at: float) -> tuple[dict[str, Any], float]:
    """The engine's abort record after ``mark``, and how long after the close it was seen."""
    deadline = closed_at + 10
    while time.monotonic() < deadline:
        recs = [
            w
            for w in get_json(f"{stack.sim_url}/admin/work?after={mark}")["requests"]
            if w["finished_reason"] == "abort"
        ]
        if recs:
            return recs[0], time.monotonic() - closed_at
        time.sleep(0.005)
    raise AssertionError("the engine never aborted the request its client left")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_hangs_up_stops_the_engine_and_pays_for_what_it_did(
    stack: Stack, stream: bool
) -> None:
    learn_rate(stack)
    mark = get_json(f"{stack.sim_url}/admin/work?after=999999999")["count"]
    # The estimate may exceed the engine's work by the rate x (prefill + the abort's lag).
    billing = Billing.of(
        stack, estimate_slack=PACE // 5, estimate_over=PACE // 2, counted_slack=PACE // 2
    )
    got, closed = cut(stack, chat(1000, stream=stream), 1.0)
    assert (b"data:" in got) == stream, got[:300]  # a JSON answer would come only when done
    work, seen_after = engine_abort_after(stack, mark, closed)
    assert seen_after < ABORT_BOUND_S, (
        f"the engine aborted {seen_after:.3f} s after the client left"
    )
    # About one second at PACE: the engine stopped, it did not go on to the 1000 asked for.
    assert PACE * 0.5 <= work["generation_tokens"] <= PACE * (1.0 + ABORT_BOUND_S) + 2, work
    stack.wait_settled()
    basis = (
        "counted" if stream and stack.gateway["response_processing"] == "streamed" else "estimated"
    )
    (pair,) = billing.check(expect={basis: 1})
    assert pair.work is not None and pair.work["finished_reason"] == "abort"


def test_every_way_a_request_ends_is_billed_as_the_engine_processed_it(stack: Stack) -> None:
    learn_rate(stack)
    billing = Billing.of(stack, estimate_slack=PACE // 5, counted_slack=4)
    pace = {"x-sim-tps": str(PACE)}
    assert post(stack, CHAT, chat(8)).status_code == 200  # completed, JSON
    r = post(
        stack, CHAT, chat(8, stream=True), pace
    )  # completed, usage asked for by Sluice and hidden
    assert r.status_code == 200 and '"usage":{' not in r.text
    r = post(stack, CHAT, chat(8, stream=True, stream_options={"include_usage": True}), pace)
    assert r.status_code == 200 and '"usage":{' in r.text
    r = post(stack, CHAT, chat(8), {"x-sim-status": "500"})  # the backend fails before generating
    assert r.status_code == 500
    with pytest.raises(httpx.RemoteProtocolError):  # the backend drops the connection mid-stream
        post(stack, CHAT, chat(20, stream=True), {**pace, "x-sim-fail-after": "5"})
    r = post(stack, CHAT, chat(10_000))  # refused after counting: over the context window
    assert r.status_code == 400 and r.headers["x-sluice-reason"] == "context_length"
    r = post(
        stack, "/v1/embeddings", {"model": "sim-llama-8b", "input": ["one two three", "four five"]}
    )
    assert r.status_code == 200
    stack.wait_settled()
    cut_basis = "counted" if stack.gateway["response_processing"] == "streamed" else "estimated"
    pairs = billing.check(expect={"reported": 4, "failed": 1, cut_basis: 1, "refused_counted": 1})
    charged, processed = billing.totals([p for p in pairs if p.basis == "reported"])
    assert charged == processed > 0


def test_an_embeddings_list_is_counted_whole_checked_by_input_and_billed_from_the_engine(
    stack: Stack,
) -> None:
    """25,000 one-token inputs were reserved and charged 4,097 (the count stopped at the
    context window); one input over the window went to the engine and came back an
    unbilled 400 without Sluice's reason."""
    billing = Billing.of(stack)
    r = post(stack, "/v1/embeddings", {"model": "sim-llama-8b", "input": ["x"] * 25_000})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 25_000
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1_000_000 - 25_000  # reserved whole
    long_input = " the" * 5_000  # 5,000 tokens; the window is 4,096
    r = post(
        stack,
        "/v1/embeddings",
        {"model": "sim-llama-8b", "input": ["short", long_input, "also short"]},
    )
    assert r.status_code == 400, r.text
    assert r.headers["x-sluice-reason"] == "context_length"
    err = r.json()["error"]
    assert (
        err["param"] == "input[1]"
        and "input[1]" in err["message"]
        and err["code"] == "context_length_exceeded"
    )
    r = post(
        stack, "/v1/embeddings", {"model": "sim-llama-8b", "input": [[1, 2, 3], list(range(5000))]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]"
    stack.wait_settled()
    pairs = billing.check(expect={"reported": 1, "refused_counted": 1})
    (done,) = [p for p in pairs if p.basis == "reported"]
    assert done.charged == done.processed == 25_000
