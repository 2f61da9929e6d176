"""A request Sluice refuses from its headers costs it little of its upload, on either stack.

Envoy streams the request body to Sluice without waiting for the headers' answer (the
one-round-trip request side, docs/round-trips.md), so what reaches Sluice of a refused
upload is what the ext_proc stream's HTTP/2 window let Envoy send before the refusal came
back: 128 KiB on Sluice's own server (``extproc.wire.h2grpc.frames.STREAM_WINDOW``), and
grpc.aio's fixed 64 KiB with its window growth off (``extproc.service.server``). Counted
by Envoy itself: the ext_proc filter state's ``bytes_sent`` in its access log."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from tests.e2e.harness import Stack, eventually, running

pytestmark = pytest.mark.e2e
MIB = 1 << 20
UPLOAD = json.dumps({"model": "sim-llama-8b", "messages": [{"role": "user", "content": "x" * (3 * MIB // 2)}]}).encode()
UNKNOWN_KEY = "sk-nobody-has-this-key-0123456789"


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp(f"refused-{request.param}"), gateway={"max_body_bytes": 2 * MIB},
              extproc_args=["--grpc-stack", request.param])
    with running(s) as started:
        yield started


def refused_uploads(stack: Stack) -> list[int]:
    """``bytes_sent`` on the ext_proc stream of each request Sluice refused for its key (all
    this module's requests; Envoy may log one before the rest of its body has come in)."""
    return [(e.get("ext_proc") or {}).get("bytes_sent", 0) for e in stack.access_log()
            if e.get("status") == 401 and e.get("sluice_reason") == "unknown_key"]


def test_an_upload_refused_from_its_headers_mostly_stays_in_envoy(stack: Stack) -> None:
    c = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=30)
    try:
        for _ in range(8):
            c.request("POST", "/v1/chat/completions", body=UPLOAD,
                      headers={"authorization": f"Bearer {UNKNOWN_KEY}", "content-type": "application/json"})
            r = c.getresponse()
            body = json.loads(r.read())
            assert r.status == 401 and body["error"]["code"] == "invalid_api_key", (r.status, body)
            if r.getheader("connection") == "close":
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=30)
    finally:
        c.close()
    sent = eventually(lambda: len(refused_uploads(stack)) == 8 and refused_uploads(stack), 5,
                      lambda: f"8 refusals in Envoy's access log, not {len(refused_uploads(stack))}")
    # Sluice's answer leaves at once, so Envoy got about one window out, not 1.5 MiB (which
    # it did with a 16 MiB window, and grpc.aio's window grown by its bandwidth probe).
    assert max(sent) <= MIB // 4, sent
