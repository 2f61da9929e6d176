"""Sluice as the endpoint picker under gateways' own Envoy configs, through the real Envoy 1.40.

Each module-scoped stack is one gateway: GIE's reference config and llm-d-router's e2e config
as vendored (only addresses and ports changed), and Envoy AI Gateway's generated settings
(``failure_mode_allow: false``, ``message_timeout: 300s``; FULL_DUPLEX and its BUFFERED
annotation); GIE's once more with the picker port on grpc.aio (``--picker-stack grpcio``). Every
test runs under each; after each, the harness's fixture checks that
nothing is in flight and the ledger balances.

The data-plane half of GIE's conformance suite (``conformance/tests/`` there) is reproduced
with Sluice's own picks standing in for the conformance picker's header-driven ones:
requests land only on the endpoints the picker named (100 at once), and the engine that
served is the one named. Sluice's own: TPM pre-charge and exact settle against the engines'
counters, 401/400/413/429 OpenAI-shaped, a stream cut by its client released once.
"""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.harness import TEST_KEYS, eventually, running
from tests.e2e.picker_stack import (
    MODEL,
    PickerStack,
    Render,
    render_aigw,
    render_vendored,
)

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
PREMIUM = {"authorization": f"Bearer {TEST_KEYS['premium']}"}
# The gateway's config, and how Sluice serves its picker port: its own HTTP/2 server by
# default, grpc.aio with --picker-stack grpcio (the same tests hold under both).
GATEWAYS: dict[str, tuple[Render, tuple[str, ...]]] = {
    "gie": (render_vendored("gie"), ()),
    "gie-grpcio": (render_vendored("gie"), ("--picker-stack", "grpcio")),
    "llmd": (render_vendored("llmd"), ()),
    "aigw": (render_aigw(), ()),
    "aigw-buffered": (render_aigw("BUFFERED"), ()),
}


@pytest.fixture(scope="module", params=sorted(GATEWAYS))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    render, args = GATEWAYS[request.param]
    s = PickerStack(tmp_path_factory.mktemp(f"picker-{request.param}"), render, args)
    s.label = request.param
    with running(s):
        yield s


def chat(content: str = "hello there", max_tokens: int = 16, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


def engine_counter(s: PickerStack, i: int, name: str, label: str = "") -> float:
    """A counter from engine ``i``'s own /metrics, summed over the series carrying ``label``."""
    text = httpx.get(f"{s.engine_url(i)}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line)


def engines_total(s: PickerStack, name: str, label: str = "") -> float:
    return sum(engine_counter(s, i, name, label) for i in range(len(s.engine_ports)))


def served_by(s: PickerStack) -> list[tuple[int, str | None]]:
    """(engine index, the x-gateway-destination-endpoint it received) per completion request."""
    return [(i, r["headers"].get("x-gateway-destination-endpoint")) for i in range(len(s.engine_ports))
            for r in s.engine_requests(i) if r["path"] == CHAT]


def clear_engines(s: PickerStack) -> None:
    for i in range(len(s.engine_ports)):
        httpx.delete(f"{s.engine_url(i)}/admin/requests", timeout=5)


def with_endpoints(s: PickerStack, keep: list[int]) -> None:
    """Reload the policy with only the engines ``keep`` in the pool; wait until Sluice has it."""
    assert s.policy_doc is not None
    doc = copy.deepcopy(s.policy_doc)
    doc["backends"][0]["endpoints"] = [e for i, e in enumerate(doc["backends"][0]["endpoints"]) if i in keep]
    s.write_policy(doc)
    want = {f"127.0.0.1:{s.engine_ports[i]}" for i in keep}
    eventually(lambda: {e["address"] for e in s.state()["backends"]["pool"]["endpoints"]
                        if not e["draining"]} == want, 10, f"the pool to be {sorted(want)}")


def test_requests_land_only_on_the_endpoints_the_picker_named(stack: PickerStack) -> None:
    """GatewayFollowingEPPRouting: 100 requests at once; each engine served exactly what Sluice
    named it for, and the engine out of the pool none."""
    with_endpoints(stack, [0, 1])
    clear_engines(stack)
    try:
        with ThreadPoolExecutor(100) as pool:
            codes = list(pool.map(lambda _: httpx.post(stack.url + CHAT, headers=PREMIUM, json=chat(),
                                                       timeout=60).status_code, range(100)))
        assert codes == [200] * 100
        served = served_by(stack)
        assert len(served) == 100
        for i, named in served:
            assert named == f"127.0.0.1:{stack.engine_ports[i]}", served
        assert {i for i, _ in served} <= {0, 1}
    finally:
        with_endpoints(stack, [0, 1, 2])


def test_tpm_precharge_and_exact_settle(stack: PickerStack) -> None:
    """A stream's usage, read from the streamed body the gateway sends Sluice, is what is charged:
    the same count the engines' own counters show."""
    before = stack.state()["ledger"]
    prompt0 = engines_total(stack, "vllm:prompt_tokens_total")
    gen0 = engines_total(stack, "vllm:generation_tokens_total")
    with httpx.stream("POST", stack.url + CHAT, headers=PREMIUM, json=chat(max_tokens=40, stream=True),
                      timeout=30) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    after = stack.wait_settled()["ledger"]
    used = (engines_total(stack, "vllm:prompt_tokens_total") - prompt0) + \
        (engines_total(stack, "vllm:generation_tokens_total") - gen0)
    assert used > 0
    assert after["charged"] - before["charged"] == used
    precharged = after["precharged"] - before["precharged"]
    assert precharged >= used  # the reservation covered it; the rest went back
    assert after["refunded"] - before["refunded"] == precharged - used


def test_usage_chunk_hidden_unless_asked(stack: PickerStack) -> None:
    def events(body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream("POST", stack.url + CHAT, headers=PREMIUM, json=body, timeout=30) as r:
            assert r.status_code == 200
            raw = "".join(r.iter_text())
        return [json.loads(line[6:]) for line in raw.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    plain = events(chat(stream=True))
    assert plain and not any(e.get("usage") for e in plain)  # Sluice asked for it, and took it out
    asked = events(chat(stream=True, stream_options={"include_usage": True}))
    assert asked[-1]["usage"]["completion_tokens"] > 0


def error_of(r: httpx.Response) -> dict[str, Any]:
    doc = r.json()
    assert set(doc["error"]) >= {"message", "type", "code"}, doc
    return doc["error"]


def test_unknown_key_401(stack: PickerStack) -> None:
    r = httpx.post(stack.url + CHAT, headers={"authorization": "Bearer sk-nobody"}, json=chat(), timeout=10)
    assert r.status_code == 401
    assert r.headers["x-sluice-reason"] == "unknown_key"
    assert error_of(r)["code"] == "invalid_api_key"


def test_bad_body_400(stack: PickerStack) -> None:
    r = httpx.post(stack.url + CHAT, headers={**PREMIUM, "content-type": "application/json"},
                   content=b'{"model": ', timeout=10)
    assert r.status_code == 400
    assert r.headers["x-sluice-reason"] == "bad_request"
    error_of(r)


def test_body_too_large_413(stack: PickerStack) -> None:
    big = chat(content="word " * 60_000)  # ~300 KB, over the policy's 256 KiB
    r = httpx.post(stack.url + CHAT, headers=PREMIUM, json=big, timeout=20)
    assert r.status_code == 413
    assert r.headers["x-sluice-reason"] == "body_too_large"
    error_of(r)


def test_tpm_429_with_retry_after(stack: PickerStack) -> None:
    tiny = {"authorization": f"Bearer {TEST_KEYS['tiny']}"}  # 600 tokens per minute
    first = httpx.post(stack.url + CHAT, headers=tiny, json=chat(max_tokens=500), timeout=20)
    assert first.status_code == 200
    r = httpx.post(stack.url + CHAT, headers=tiny, json=chat(max_tokens=500), timeout=20)
    assert r.status_code == 429
    assert r.headers["x-sluice-reason"] in ("tpm", "tpm_request_too_large")
    assert int(r.headers["retry-after"]) >= 1
    assert error_of(r)["code"] == "rate_limit_exceeded"


def test_client_cut_stream_releases_once(stack: PickerStack) -> None:
    """A client that leaves mid-stream: its slot and reservation go back once, and the engine
    aborted the sequence (its own counter). Under a BUFFERED response the client has nothing to
    read before the end, so it leaves while the engine generates."""
    aborted0 = engines_total(stack, "vllm:request_success_total", 'finished_reason="abort"')
    settled0 = stack.state()["ledger"]
    if stack.label.endswith("buffered"):
        body = json.dumps(chat(max_tokens=2000, stream=True)).encode()
        with socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=10) as conn:
            conn.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         + f"authorization: {PREMIUM['authorization']}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                         + body)
            eventually(lambda: engines_total(stack, "vllm:num_requests_running") >= 1, 10,
                       "the engine to be generating")
    else:
        with httpx.stream("POST", stack.url + CHAT, headers=PREMIUM, json=chat(max_tokens=2000, stream=True),
                          timeout=30) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            got = [next(it) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
    st = stack.wait_settled(timeout=10)
    assert st["in_flight"] == 0
    ledger = st["ledger"]
    charged = ledger["charged"] - settled0["charged"]
    refunded = ledger["refunded"] - settled0["refunded"]
    precharged = ledger["precharged"] - settled0["precharged"]
    assert precharged + (ledger["excess"] - settled0["excess"]) == charged + refunded
    assert 0 < charged < precharged  # what it used (at least the prompt), not its reservation
    eventually(lambda: engines_total(stack, "vllm:request_success_total", 'finished_reason="abort"')
               == aborted0 + 1, 10, "the engine to abort the cut stream's sequence")


def test_long_stream_under_a_buffered_response(stack: PickerStack) -> None:
    """A BUFFERED response holds the whole stream in Envoy: past the listener's buffer (32 KiB in
    GIE's config) Envoy answers 500 itself. Under FULL_DUPLEX the same stream goes through."""
    r = httpx.post(stack.url + CHAT, headers=PREMIUM, json=chat(max_tokens=2000, stream=True), timeout=60)
    assert r.status_code == (500 if stack.label.endswith("buffered") else 200)
    if r.status_code == 200:
        assert r.text.rstrip().endswith("data: [DONE]")


def test_models_list_answered_by_sluice(stack: PickerStack) -> None:
    r = httpx.get(stack.url + "/v1/models", headers=PREMIUM, timeout=10)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


def test_nothing_lost_against_the_engines(stack: PickerStack) -> None:
    """Sluice's admitted count and the engines' finished count move together."""
    done0 = engines_total(stack, "vllm:request_success_total")
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: httpx.post(stack.url + CHAT, headers=PREMIUM,
                                                   json=chat(stream=bool(i % 2)), timeout=30).status_code,
                              range(24)))
    assert codes == [200] * 24
    eventually(lambda: engines_total(stack, "vllm:request_success_total") - done0 == 24, 10,
               "the engines to finish all 24")
