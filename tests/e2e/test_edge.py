"""Edge hygiene of the generated Envoy config, through the real Envoy.

Client-sent internal headers are not trusted, credentials in query strings are neither
logged nor forwarded, and slow or piled-up connections are cut off by the gateway's
request_headers_timeout_s, request_timeout_s and max_connections.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import TEST_KEYS, Stack, eventually, running

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 3
HEADERS_TIMEOUT_S = 2
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    gateway = {"request_timeout_s": REQUEST_TIMEOUT_S, "request_headers_timeout_s": HEADERS_TIMEOUT_S,
               "max_connections": MAX_CONNECTIONS}
    with running(Stack(tmp_path_factory.mktemp("edge"), gateway=gateway)) as s:
        yield s


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TEST_KEYS['premium']}", "content-type": "application/json"}


def chat(text: str = "hi") -> dict[str, Any]:
    return {"model": "sim-llama-8b", "messages": [{"role": "user", "content": text}], "max_tokens": 4}



def log_line_for(stack: Stack, marker: str) -> dict[str, Any]:
    """The access-log line of the request whose prompt carried ``marker`` (matched by bytes_in)."""
    return eventually(lambda: next((e for e in stack.access_log() if e.get("upstream_cluster") == "sim"
                                    and e.get("bytes_in") == len(marker)), None), 5, "the access log line")


def test_client_sent_internal_headers_are_not_trusted(stack: Stack) -> None:
    body = json.dumps(chat("forged headers")).encode()
    r = httpx.post(stack.url + CHAT, content=body, headers={
        **auth(), "x-envoy-original-path": "/admin", "x-request-id": "forged",
        "x-envoy-upstream-rq-timeout-ms": "1", "x-forwarded-for": "10.9.9.9"}, timeout=20)
    assert r.status_code == 200, r.text
    line = eventually(lambda: next((e for e in stack.access_log() if e.get("bytes_in") == len(body)), None), 5,
                      "the access log line")
    assert line["path"] == CHAT
    assert line["request_id"] not in ("forged", None) and len(line["request_id"]) == 36
    (seen,) = [s for s in stack.sim_requests() if s["body_len"] and s["json"]["messages"][0]["content"]
               == "forged headers"]
    upstream = {k.lower(): v for k, v in seen["headers"].items()}
    assert upstream["x-request-id"] == line["request_id"]
    assert "x-envoy-original-path" not in upstream and "x-envoy-upstream-rq-timeout-ms" not in upstream
    # The client is the peer address, not what it claimed: Envoy appends its own hop to
    # X-Forwarded-For (for a loopback peer, Envoy's local address) and names the peer in
    # x-envoy-external-address, set only for requests from outside.
    hops = [h.strip() for h in upstream["x-forwarded-for"].split(",")]
    assert hops[0] == "10.9.9.9" and len(hops) == 2
    assert upstream["x-envoy-external-address"] == "127.0.0.1"


def test_query_string_keys_are_neither_logged_nor_forwarded(stack: Stack) -> None:
    stack.clear_sim_requests()
    secret = "sk-query-secret-123"
    body = json.dumps(chat("query key")).encode()
    r = httpx.post(f"{stack.url}{CHAT}?api_key={secret}&keep=1&API-KEY={secret}&token={secret}",
                   content=body, headers=auth(), timeout=20)
    assert r.status_code == 200, r.text
    (seen,) = stack.sim_requests()
    assert seen["path"] == CHAT
    assert seen["query"] == "keep=1"  # the other parameters go through as sent
    assert secret not in json.dumps(seen)
    line = eventually(lambda: next((e for e in stack.access_log() if e.get("bytes_in") == len(body)), None), 5,
                      "the access log line")
    assert line["path"] == CHAT
    # an unauthenticated request with the key only in the query: 401, and still not logged
    r = httpx.post(f"{stack.url}{CHAT}?key={secret}", content=body, headers={"content-type": "application/json"},
                   timeout=20)
    assert r.status_code == 401
    eventually(lambda: any(e.get("status") == 401 for e in stack.access_log()), 5, "the 401's log line")
    assert secret not in (stack.workdir / "envoy.log").read_text()


def _dribble(stack: Stack, head: bytes, every_s: float, until_s: float) -> tuple[bytes, float]:
    """Send ``head``, then one byte every ``every_s`` until the server closes; (reply, seconds)."""
    sock = socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=every_s)
    started = time.monotonic()
    got = b""
    try:
        sock.sendall(head)
        while time.monotonic() - started < until_s:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        else:
            raise AssertionError(f"still open after {until_s} s")
    finally:
        sock.close()
    return got, time.monotonic() - started


def test_dribbling_upload_is_cut_off_by_the_request_timeout(stack: Stack) -> None:
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TEST_KEYS['premium']}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n{").encode()
    got, took = _dribble(stack, head, every_s=2, until_s=REQUEST_TIMEOUT_S + 10)
    assert REQUEST_TIMEOUT_S - 0.5 <= took <= REQUEST_TIMEOUT_S + 5, took
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    head_part, _, body = got.partition(b"\r\n\r\n")
    assert b"x-sluice-reason: request_timeout" in head_part.lower()
    if b"transfer-encoding: chunked" in head_part.lower():
        body = body.split(b"\r\n")[1]
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}


def test_slow_headers_are_cut_off_by_the_headers_timeout(stack: Stack) -> None:
    got, took = _dribble(stack, f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-slow: ".encode(), every_s=0.5,
                         until_s=HEADERS_TIMEOUT_S + 10)
    assert HEADERS_TIMEOUT_S - 0.5 <= took <= HEADERS_TIMEOUT_S + 5, took
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:300]


def test_request_timeout_does_not_limit_a_streaming_response(stack: Stack) -> None:
    # request_timeout ends when the request has gone upstream: a response that streams for
    # longer than it is not cut (the simulated backend paces tokens; ask for enough of them).
    started = time.monotonic()
    events = 0
    with httpx.stream("POST", stack.url + CHAT, headers={**auth(), "x-sim-tps": "10", "x-sim-tokens": "50"},
                      json={**chat("stream"), "max_tokens": 50, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += line.startswith("data: {")
    took = time.monotonic() - started
    assert took > REQUEST_TIMEOUT_S, (took, events, "the stream must outlast the request timeout to show this")
    assert events >= 40


def test_connections_beyond_the_limit_are_refused(stack: Stack) -> None:
    held: list[httpx.Client] = []
    try:
        for _ in range(MAX_CONNECTIONS):  # keep-alive connections, each accepted by Envoy
            c = httpx.Client(base_url=stack.url, timeout=10)
            assert c.post(CHAT, headers=auth(), json=chat()).status_code == 200
            held.append(c)
        with pytest.raises(httpx.TransportError):
            httpx.post(stack.url + CHAT, headers=auth(), json=chat(), timeout=5)
        # Envoy's admin port is not counted: health checks and stats still answer
        ready = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/ready", timeout=5)
        assert ready.status_code == 200
        stats = httpx.get(f"http://127.0.0.1:{stack.envoy_admin_port}/stats?filter=global_cx_overflow",
                          timeout=5).text
        refused = [line for line in stats.splitlines() if line.startswith(f"listener.127.0.0.1_{stack.envoy_port}.")]
        assert refused and int(refused[0].rsplit(" ", 1)[1]) >= 1, stats  # counted as the limit's doing
    finally:
        for c in held:
            c.close()
    # capacity comes back as soon as connections close
    ok = eventually(lambda: httpx.post(stack.url + CHAT, headers=auth(), json=chat(), timeout=5).status_code == 200,
                    5, "a connection after the held ones closed")
    assert ok
