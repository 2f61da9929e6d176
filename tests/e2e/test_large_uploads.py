"""Oversized uploads get a readable 413, through the real Envoy.

Envoy replying before the body is read closes with unread data and the kernel's RST
destroys the 413; so the generated config routes a content-length over the cap to the
drain (extproc/service/drain.py), which reads and discards the body and answers 413 after it.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
MB = 1 << 20
CAP = 256 * 1024  # the test policy's max_body_bytes
DRAIN_MAX = 40 * MB
DRAIN_TIMEOUT_S = 3.0
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    gateway = {"drain_max_bytes": DRAIN_MAX, "drain_timeout_s": DRAIN_TIMEOUT_S}
    with running(Stack(tmp_path_factory.mktemp("uploads"), gateway=gateway)) as s:
        yield s


def chat_bytes(size: int) -> bytes:
    head = b'{"model": "sim-llama-8b", "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"a " * ((size - len(head) - len(tail)) // 2) + tail


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TEST_KEYS['premium']}", "content-type": "application/json"}


def drained(stack: Stack, outcome: str = "drained") -> int:
    m = re.search(rf'^sluice_drained_uploads_total{{outcome="{outcome}"}} (\S+)$', stack.metrics_text(), re.M)
    return int(float(m.group(1))) if m else 0


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def assert_413(status: int, headers: dict[str, str], body: bytes, size: int) -> None:
    assert status == 413, (status, body[:300])
    assert headers["x-sluice-reason"] == "body_too_large"
    err = json.loads(body)["error"]
    assert set(err) == ERROR_KEYS, err
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "body_too_large"
    assert err["param"] is None
    assert str(size) in err["message"] and str(CAP) in err["message"], err["message"]


@pytest.mark.parametrize("mb", [2, 6, 32])
def test_http_client_reads_the_413(stack: Stack, mb: int) -> None:
    body = chat_bytes(mb * MB)
    before = drained(stack)
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=30)
    try:
        conn.request("POST", CHAT, body=body, headers=auth())
        resp = conn.getresponse()
        assert_413(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read(), len(body))
        # The exchange completed cleanly: the same connection serves the next request.
        conn.request("POST", CHAT, body=json.dumps({"model": "sim-llama-8b", "messages": [
            {"role": "user", "content": "hi"}]}), headers=auth())
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert drained(stack) == before + 1


@pytest.mark.parametrize("mb", [2, 6, 32])
def test_httpx_reads_the_413(stack: Stack, mb: int) -> None:
    body = chat_bytes(mb * MB)
    before = drained(stack)
    r = httpx.post(stack.url + CHAT, content=body, headers=auth(), timeout=30)
    assert_413(r.status_code, dict(r.headers), r.content, len(body))
    assert drained(stack) == before + 1


@pytest.mark.parametrize("mb", [2, 6, 32])
def test_openai_sdk_gets_413_and_does_not_retry(stack: Stack, mb: int) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=TEST_KEYS["premium"], max_retries=2, timeout=30)
    before = drained(stack)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="sim-llama-8b",
                                       messages=[{"role": "user", "content": "a " * (mb * MB // 2)}])
    err = info.value
    assert err.status_code == 413
    assert err.code == "body_too_large" and err.type == "invalid_request_error"
    assert err.response.headers["x-sluice-reason"] == "body_too_large"
    assert drained(stack) == before + 1  # one upload: the SDK did not retry
    client.close()


def test_http2_client_gets_413(stack: Stack) -> None:
    body = chat_bytes(6 * MB)
    before = drained(stack)
    with httpx.Client(http1=False, http2=True, timeout=30) as client:  # h2c, prior knowledge
        r = client.post(stack.url + CHAT, content=body, headers=auth())
        assert r.http_version == "HTTP/2"
        assert_413(r.status_code, dict(r.headers), r.content, len(body))
        ok = client.post(stack.url + CHAT, headers=auth(), json={
            "model": "sim-llama-8b", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    assert drained(stack) == before + 1


def test_http2_upload_without_content_length_gets_envoys_413(stack: Stack) -> None:
    # No content-length, so no drain route: Envoy's buffer overflows and it answers 413
    # itself; on HTTP/2 that ends one stream (RST_STREAM), and the client reads the reply.
    body = chat_bytes(6 * MB)
    before = drained(stack)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), MB):
            yield body[i:i + MB]

    with httpx.Client(http1=False, http2=True, timeout=30) as client:
        r = client.post(stack.url + CHAT, content=chunks(), headers=auth())
    assert r.status_code == 413, r.text
    assert r.headers["x-sluice-reason"] == "body_too_large"
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] is None and err["type"] == "invalid_request_error"
    assert drained(stack) == before


def test_under_the_cap_is_judged_by_extproc_not_the_drain(stack: Stack) -> None:
    before = drained(stack)
    r = httpx.post(stack.url + CHAT, content=chat_bytes(CAP - 1024), headers=auth(), timeout=30)
    # ext_proc read and tokenized it: too long for the model's window, not too large
    assert r.status_code == 400, r.text
    assert r.headers["x-sluice-reason"] == "context_length"
    assert drained(stack) == before


def test_only_the_endpoints_sluice_reads_are_drained(stack: Stack) -> None:
    before = drained(stack)
    for path in ("/v1/completions", "/v1/embeddings"):
        r = httpx.post(stack.url + path, content=chat_bytes(2 * MB), headers=auth(), timeout=30)
        assert r.status_code == 413 and r.headers["x-sluice-reason"] == "body_too_large"
    assert drained(stack) == before + 2
    # any other path is extproc's to judge (404 here; streamed when unknown_paths is passthrough)
    r = httpx.post(stack.url + "/v1/files?x=1", content=b"a" * (CAP + 1024), headers=auth(), timeout=30)
    assert r.status_code == 404 and r.headers["x-sluice-reason"] == "unknown_path"
    assert drained(stack) == before + 2


def test_oversized_uploads_never_reach_the_backend_or_extproc(stack: Stack) -> None:
    stack.clear_sim_requests()
    text = stack.metrics_text()
    httpx.post(stack.url + CHAT, content=chat_bytes(2 * MB), headers=auth(), timeout=30)
    assert stack.sim_requests() == []
    # ext_proc never saw it: no request counted for any tenant, nothing pre-charged
    assert re.findall(r"^sluice_requests_total.*$", stack.metrics_text(), re.M) == \
        re.findall(r"^sluice_requests_total.*$", text, re.M)


def _raw_upload(stack: Stack, length: int, first: int, trickle_s: float | None, until: float) -> bytes:
    """Declare ``length`` bytes, send ``first`` of them, then one byte per ``trickle_s`` (or
    nothing) while reading; return what the server sent before closing (or resetting)."""
    sock = socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=0.5)
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TEST_KEYS['premium']}\r\n"
            f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n").encode()
    got = b""
    try:
        sock.sendall(head + b"a" * first)
        deadline = time.monotonic() + until
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if trickle_s is not None:
                    try:
                        sock.sendall(b"a")
                    except (ConnectionResetError, BrokenPipeError):
                        break  # the bound cut the connection between two reads
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        else:
            raise AssertionError(f"connection still open after {until} s; got {got[:200]!r}")
    finally:
        sock.close()
    return got


def test_slow_uploader_is_cut_off_at_the_drain_time_bound(stack: Stack) -> None:
    before = drained(stack, "timeout")
    started = time.monotonic()
    got = _raw_upload(stack, length=2 * MB, first=64 * 1024, trickle_s=0.5, until=DRAIN_TIMEOUT_S + 10)
    took = time.monotonic() - started
    assert DRAIN_TIMEOUT_S - 0.5 <= took <= DRAIN_TIMEOUT_S + 10
    assert drained(stack, "timeout") == before + 1
    if got:  # the client may read the 413 before the close, or lose it to the reset
        assert got.startswith(b"HTTP/1.1 413"), got[:200]


def test_body_over_the_drain_limit_is_cut_off(stack: Stack) -> None:
    before_over, before_bytes = drained(stack, "over_drain_limit"), stack.metrics_text()
    started = time.monotonic()
    got = _raw_upload(stack, length=DRAIN_MAX + MB, first=MB, trickle_s=None, until=10)
    assert time.monotonic() - started < 10
    assert drained(stack, "over_drain_limit") == before_over + 1
    if got:
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
    # refused at once, without reading the body
    bytes_line = re.compile(r"^sluice_drained_bytes_total (\S+)$", re.M)
    assert bytes_line.search(stack.metrics_text()).group(1) == bytes_line.search(before_bytes).group(1)


def test_32mb_rejection_costs_little_memory_and_time(stack: Stack) -> None:
    envoy, extproc = stack.procs["envoy"].pid, stack.procs["extproc"].pid
    body = chat_bytes(32 * MB)
    httpx.post(stack.url + CHAT, content=chat_bytes(2 * MB), headers=auth(), timeout=30)  # warm up
    before = {"envoy": rss_kb(envoy), "extproc": rss_kb(extproc)}
    started = time.perf_counter()
    r = httpx.post(stack.url + CHAT, content=body, headers=auth(), timeout=30)
    took = time.perf_counter() - started
    after = {"envoy": rss_kb(envoy), "extproc": rss_kb(extproc)}
    peak = {"envoy": rss_kb(envoy, "VmHWM"), "extproc": rss_kb(extproc, "VmHWM")}
    print(f"32 MB rejected upload: {took * 1000:.0f} ms; RSS kB before {before}, after {after}, peak {peak}")
    assert r.status_code == 413
    for name in ("envoy", "extproc"):
        # streamed, never buffered whole: far less than the 32 MB body
        assert after[name] - before[name] < 12 * 1024, (name, before, after)
    assert took < 10
