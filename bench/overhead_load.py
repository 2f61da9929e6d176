"""The load generator of ``bench.overhead``: one fixed chat completion over HTTP/1.1
keep-alive connections, timed per request.

asyncio protocols with prebuilt request bytes, parsing only the status line and the
content-length or chunked framing, keep the client's own cost per request small next to
what is being measured (Envoy streams the response body through ext_proc, so (b) and (c)
answer chunked).
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from dataclasses import dataclass

KEY = "sk-bench-overhead"
MODEL = "bench-model"

# ~200 bytes: a small chat completion that names its max_tokens, so Sluice forwards it unchanged.
BODY = json.dumps({
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hello to the benchmark in five words or fewer, please."},
    ],
    "max_tokens": 64,
    "temperature": 0,
}, separators=(",", ":")).encode()


def request_bytes() -> bytes:
    head = ("POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n\r\n")
    return head.encode() + BODY


def _response_end(buf: bytearray) -> tuple[int, int] | None:
    """(status, length) of the complete HTTP/1.1 response at the start of ``buf``, or None."""
    hend = buf.find(b"\r\n\r\n")
    if hend < 0:
        return None
    status = int(buf[9:12])
    head = bytes(buf[:hend]).lower()
    start = hend + 4
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        end = start + int(head[i + 17:j if j >= 0 else len(head)])
        return (status, end) if len(buf) >= end else None
    if b"\r\ntransfer-encoding: chunked" not in head:
        return (status, start)  # e.g. 204; this client never reads to close
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            if buf[eol + 2:eol + 4] == b"\r\n":
                return status, eol + 4
            t = buf.find(b"\r\n\r\n", eol + 2)
            return None if t < 0 else (status, t + 4)
        pos = eol + 2 + size + 2
        if len(buf) < pos:
            return None


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None:
            return
        done = _response_end(self.buf)
        if done is not None:
            del self.buf[:done[1]]
            waiter, self.waiter = self.waiter, None
            waiter.set_result(done[0])

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed mid-response"))

    async def call(self, data: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, "127.0.0.1", port)
    client.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


@dataclass
class Sample:
    latencies_ns: list[int]
    errors: int
    seconds: float
    warmup_requests: int = 0  # sent before the measured ones (they cost CPU too)

    @property
    def rps(self) -> float:
        return len(self.latencies_ns) / self.seconds if self.seconds else 0.0


async def _drive(port: int, conns: int, warm: float, *, count: int = 0, seconds: float = 0.0) -> Sample:
    """Warm up for ``warm`` s, then ``count`` sequential requests per connection or ``seconds`` of load."""
    clients = [await _connect(port) for _ in range(conns)]
    req = request_bytes()
    lat: list[int] = []
    errors = warmed = 0

    async def loop(c: _Client, until: float, n: int, data: bytes, record: bool) -> None:
        nonlocal errors, warmed
        clock = time.perf_counter_ns
        while len(lat) < n if n else time.perf_counter() < until:
            t0 = clock()
            status = await c.call(data)
            if record:
                lat.append(clock() - t0)
                errors += status != 200
            else:
                warmed += 1
                errors += status != 200

    end_warm = time.perf_counter() + warm
    await asyncio.gather(*(loop(c, end_warm, 0, req, False) for c in clients))
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(c, t0 + seconds, count, req, True) for c in clients))
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
        for c in clients:
            if c.transport is not None:
                c.transport.close()
    return Sample(lat, errors, elapsed, warmed)


def pct(values_ns: list[int], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    s = sorted(values_ns)
    return s[max(0, min(len(s) - 1, int(q * len(s) + 0.5) - 1))] / 1e6
