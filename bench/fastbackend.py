"""A tiny, fast, constant OpenAI backend for measuring the gateway, not the model.

Every POST gets the same non-streaming chat completion (with ``usage``), every
``GET /health`` gets ``ok`` and ``GET /metrics`` reports an idle vLLM engine. It is a
raw asyncio protocol (no framework) speaking HTTP/1.1 with keep-alive, so one
request costs the backend a few tens of microseconds and the gateway in front of it
dominates what a load generator sees.

    python -m bench.fastbackend --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

COMPLETION = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "bench-model",
    "choices": [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello, benchmark. Five words."},
        "finish_reason": "stop",
    }],
    "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38},
}

METRICS = (
    b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.0\n"
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n"
    b"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total 0.0\n"
)


def _response(status: str, ctype: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode("ascii") + body


COMPLETION_RESPONSE = _response(
    "200 OK", "application/json", json.dumps(COMPLETION, separators=(",", ":")).encode())
HEALTH_RESPONSE = _response("200 OK", "text/plain", b"ok\n")
METRICS_RESPONSE = _response("200 OK", "text/plain; version=0.0.4", METRICS)
NOT_FOUND_RESPONSE = _response("404 Not Found", "text/plain", b"not found\n")
BAD_REQUEST = _response("400 Bad Request", "text/plain", b"bad request\n")


class _Conn(asyncio.Protocol):
    """One keep-alive connection; requests may arrive in any split or pipelined."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            done = self._one()
            if done is None:
                break
            if done is BAD_REQUEST:
                out.append(done)
                assert self.transport is not None
                self.transport.write(b"".join(out))
                self.transport.close()
                return
            out.append(done)
        if out:
            assert self.transport is not None
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _one(self) -> bytes | None:
        """Consume one complete request from the buffer and return its response."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(buf[:end]).lower()
        start = end + 4
        method = head[:head.find(b" ")]
        length = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return BAD_REQUEST
            elif name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
        if chunked:
            try:
                consumed = _chunked_end(buf, start)
            except ValueError:
                return BAD_REQUEST
            if consumed is None:
                return None
        else:
            if len(buf) < start + length:
                return None
            consumed = start + length
        del buf[:consumed]
        if method == b"post":
            return COMPLETION_RESPONSE
        path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
        if path.startswith(b"/health"):
            return HEALTH_RESPONSE
        if path.startswith(b"/metrics"):
            return METRICS_RESPONSE
        return NOT_FOUND_RESPONSE


def _chunked_end(buf: bytearray, pos: int) -> int | None:
    """Index just past a complete chunked body starting at ``pos``, or None if incomplete."""
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0] or b"0", 16)
        if size == 0:
            # Optional trailers, then an empty line.
            if buf[eol + 2:eol + 4] == b"\r\n":
                return eol + 4
            trailers_end = buf.find(b"\r\n\r\n", eol + 2)
            return None if trailers_end < 0 else trailers_end + 4
        nxt = eol + 2 + size + 2
        if len(buf) < nxt:
            return None
        pos = nxt


async def serve(host: str, port: int, conn: type[asyncio.Protocol] = _Conn, name: str = "fastbackend") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(conn, host, port, backlog=1024)
    print(f"{name} listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def run(argv: list[str] | None, *, name: str, doc: str | None, default_port: int,
        conn: type[asyncio.Protocol]) -> int:
    """The command line of a raw asyncio backend: --host/--port, serve until a signal."""
    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=default_port)
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, conn, name))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(argv, name="fastbackend", doc=__doc__, default_port=8001, conn=_Conn)


if __name__ == "__main__":
    raise SystemExit(main())
