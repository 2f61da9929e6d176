"""A constant streaming backend: one SSE event per token, at a fixed pace, as vLLM sends them.

Every POST streams ``x-paced-events`` chat-completion chunks (default 200), one per
``x-paced-interval-ms`` (default 20), each its own HTTP/1.1 chunk; then the usage-only
chunk if the body asked for ``stream_options.include_usage`` (Sluice does, on the
client's behalf), then ``data: [DONE]``. ``x-paced-split-usage: 1`` writes the usage
event in two pieces 50 ms apart, glued to the events around it (a proxy must hold the
unfinished event back to remove it whole). A raw asyncio protocol, so the backend costs
little next to the gateway being measured (``bench.response_cost``).

    python -m bench.pacedbackend --port 8003
"""

from __future__ import annotations

import asyncio
import re

from bench.fastbackend import METRICS, run

EVENT = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"paced","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"chatcmpl-paced","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"paced","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n')
DONE = b"data: [DONE]\n\n"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PROMPT_TOKENS = 10
_HEADER = re.compile(rb"^([a-z0-9-]+):\s*(.*?)\s*$", re.M)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        headers = dict(_HEADER.findall(head))
        length = int(headers.get(b"content-length", b"0"))
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        if not head.startswith(b"post"):
            assert self.transport is not None
            # /metrics: an idle vLLM engine (Sluice scrapes it); anything else: ok.
            reply = METRICS if b" /metrics" in head[:64] else b"ok\n"
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
            return self._next()
        events = int(headers.get(b"x-paced-events", b"200"))
        interval = float(headers.get(b"x-paced-interval-ms", b"20")) / 1000
        usage = b'"include_usage":true' in body.replace(b" ", b"")
        split = headers.get(b"x-paced-split-usage") == b"1"
        self.busy = True
        asyncio.get_running_loop().create_task(self._stream(events, interval, usage, split))

    async def _stream(self, events: int, interval: float, usage: bool, split: bool = False) -> None:
        t = self.transport
        assert t is not None
        t.write(HEAD)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(events):
            if t.is_closing():
                return
            t.write(_chunk(EVENT))
            # Paced from the start, not from the last write: no drift under load.
            await asyncio.sleep(max(0.0, start + (i + 1) * interval - loop.time()))
        if usage and split:
            u = USAGE % (PROMPT_TOKENS, events, PROMPT_TOKENS + events)
            t.write(_chunk(EVENT + u[:60]))
            await asyncio.sleep(0.05)
            t.write(_chunk(u[60:] + DONE) + b"0\r\n\r\n")
            self.busy = False
            return self._next()
        if usage:
            t.write(_chunk(USAGE % (PROMPT_TOKENS, events, PROMPT_TOKENS + events)))
        t.write(_chunk(DONE) + b"0\r\n\r\n")
        self.busy = False
        self._next()


def main(argv: list[str] | None = None) -> int:
    return run(argv, name="pacedbackend", doc=__doc__, default_port=8003, conn=_Conn)


if __name__ == "__main__":
    raise SystemExit(main())
