"""response_processing usage_trailers end to end: Envoy's usage record, and the estimate
when it does not come (the bound README's "Response processing" promises)."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("trailers"), gateway={"response_processing": "usage_trailers"})) as s:
        yield s

AUTH = {"authorization": f"Bearer {TEST_KEYS['premium']}"}


def phase_counts(stack: Stack) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(
        r'^sluice_extproc_phase_seconds_count\{phase="([a-z_]+)"\} (\S+)$', stack.metrics_text(), re.M)}


# The estimate tests use a model no other test streams from, so they alone set its rate.
PACED = "sim-o200k"


def chat(model: str = "sim-llama-8b", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "say things"}], **extra}


def stream(stack: Stack, tokens: int, tps: int, model: str = PACED, **headers: str) -> httpx.Response:
    return httpx.post(stack.url + CHAT, json=chat(model, stream=True, max_tokens=300), timeout=30,
                      headers={**AUTH, "x-sim-tokens": str(tokens), "x-sim-tps": str(tps), **headers})


def test_usage_reaches_extproc_in_the_trailers(stack: Stack) -> None:
    before, ledger = phase_counts(stack), stack.state()["ledger"]
    r = stream(stack, 40, 400, "sim-llama-8b")
    assert r.status_code == 200
    assert r.text.count("data: {") == 40 + 1  # the role chunk, 40 tokens; the usage chunk hidden
    after = phase_counts(stack)
    # One message per response phase, none per token.
    assert after.get("response_body", 0) == before.get("response_body", 0)
    assert after["response_headers"] - before.get("response_headers", 0) == 1
    assert after["response_trailers"] - before.get("response_trailers", 0) == 1
    charged = stack.wait_settled()["ledger"]["charged"] - ledger["charged"]
    # The sim's usage: its prompt count + 40; Sluice's own prompt count is close to it.
    assert 40 < charged < 60


def _teach(stack: Stack, tps: int) -> None:
    for _ in range(3):
        assert stream(stack, 40, tps).status_code == 200
    stack.wait_settled()


def test_without_usage_the_charge_is_streaming_time_times_the_learned_rate(stack: Stack) -> None:
    _teach(stack, 50)
    before = stack.state()["ledger"]
    r = stream(stack, 60, 50, **{"x-sim-usage": "none"})
    assert r.status_code == 200 and r.text.count("data: {") == 61
    completion = stack.wait_settled()["ledger"]["charged"] - before["charged"] - 10  # ~10 prompt tokens
    # 60 tokens streamed; the estimate is within a quarter of it (the README's bound).
    assert abs(completion - 60) <= 15, completion


def test_a_client_leaving_mid_stream_is_charged_about_what_it_received(stack: Stack) -> None:
    _teach(stack, 50)
    before = stack.state()["ledger"]
    body = json.dumps(chat(PACED, stream=True, max_tokens=300)).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TEST_KEYS['premium']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nx-sim-tokens: 300\r\n"
            "x-sim-tps: 50\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", stack.envoy_port))
    sock.sendall(head + body)
    got, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < 1.0:
        chunk = sock.recv(65536)
        assert chunk
        got += chunk
    sock.close()
    received = got.count(b"data: {") - 1  # minus the role chunk
    st = stack.wait_settled(timeout=1.0)
    assert st["in_flight"] == 0
    completion = st["ledger"]["charged"] - before["charged"] - 10
    assert 30 <= received <= 70, received
    assert abs(completion - received) <= 0.25 * received + 5, (completion, received)
    # The rest of the 300-token reservation went back.
    assert st["ledger"]["refunded"] - before["refunded"] > 200


def test_embeddings_usage_arrives_in_the_trailers_too(stack: Stack) -> None:
    before, ledger = phase_counts(stack), stack.state()["ledger"]
    r = httpx.post(stack.url + "/v1/embeddings", json={"model": "sim-llama-8b", "input": ["one two three", "four"]},
                   headers=AUTH, timeout=20)
    assert r.status_code == 200, r.text
    assert phase_counts(stack)["response_trailers"] - before.get("response_trailers", 0) == 1
    charged = stack.wait_settled()["ledger"]["charged"] - ledger["charged"]
    assert charged == r.json()["usage"]["total_tokens"]
