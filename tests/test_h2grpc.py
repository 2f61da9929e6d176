"""extproc.wire.h2grpc against a real gRPC client (grpcio's C core): bidi streams in order,
messages larger than a frame and than the peer's window, many streams on one connection,
unary calls, TLS, statuses, cancellation both ways, graceful stop, and what it refuses."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from extproc.wire import tls
from extproc.wire.h2grpc.calls import Call, streaming, unary
from extproc.wire.h2grpc.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    frame,
)
from extproc.wire.h2grpc.server import Server, ssl_context
from extproc.wire.h2grpc.stream import Handler
from extproc.wire.health import SERVING, Health, HealthCheckRequest, HealthCheckResponse
from tests.waiting import eventually_async

ECHO = "/test.Echo/Stream"
CHECK = "/grpc.health.v1.Health/Check"


class Recorder:
    """A bidi handler that echoes each message prefixed, counts what went through ``fast``,
    and records how the call ended."""

    def __init__(self, fast: bool = False, fail_on: bytes | None = None) -> None:
        self.use_fast, self.fail_on = fast, fail_on
        self.fast_count = self.task_count = 0
        self.ended: list[str] = []
        self.seen: list[bytes] = []
        self.release = asyncio.Event()  # what a b"hold" message waits for

    async def run(self, call: Call) -> None:
        try:
            while (data := await call.read()) is not None:
                if data == self.fail_on:
                    raise RuntimeError("asked to fail")
                self.seen.append(data)
                if data == b"hold":
                    await self.release.wait()
                self.task_count += 1
                call.write(b"task:" + data)
            self.ended.append("eof")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise

    def fast(self, call: Call, data: bytes) -> bool:
        if not self.use_fast or not data.startswith(b"f"):
            return False
        self.fast_count += 1
        call.write(b"fast:" + data)
        return True

    def handler(self) -> Handler:
        return streaming(self.run, self.fast)


async def serve(handlers: dict[str, Handler], tls_context: Any = None) -> tuple[Server, int]:
    server = Server(handlers)
    port = await server.start("127.0.0.1", 0, tls_context)
    return server, port


def bidi(channel: grpc.aio.Channel) -> Any:
    return channel.stream_stream(ECHO, request_serializer=None, response_deserializer=None)


async def gen(items: list[bytes]) -> AsyncIterator[bytes]:
    for i in items:
        yield i


async def gen_then_hold(items: list[bytes]) -> AsyncIterator[bytes]:
    """Sends and then keeps the stream open: a write after the server has ended the call would
    make grpc's client report its own INTERNAL error instead of the server's status."""
    for i in items:
        yield i
    await asyncio.sleep(30)


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


def test_bidi_stream_in_order_with_the_fast_path() -> None:
    """Lock-step, as Envoy's ext_proc stream is: each message comes while the task waits, so
    every one that ``fast`` takes is answered there and the task sees only the others."""
    rec = Recorder(fast=True)

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        items = [b"t0", b"f1", b"f2", b"t3", b"f4"] * 20
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = bidi(ch)()
            got = []
            for i in items:
                await call.write(i)
                got.append(await call.read())
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
        await server.stop(1)
        assert got == [(b"fast:" if i.startswith(b"f") else b"task:") + i for i in items]
        assert rec.fast_count == 60 and rec.task_count == 40
        assert rec.ended == ["eof"]

    run(go)


def test_messages_queued_behind_a_busy_task_keep_their_order() -> None:
    """A burst: what comes while the task is busy waits in its queue, ``fast`` or not."""
    rec = Recorder(fast=True)

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        items = [b"t0", b"f1", b"f2", b"t3", b"f4"] * 20
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            got = [m async for m in bidi(ch)(gen(items))]
        await server.stop(1)
        assert [g.split(b":", 1)[1] for g in got] == items
        assert rec.fast_count + rec.task_count == len(items)

    run(go)


def test_messages_larger_than_a_frame_and_the_window_both_ways() -> None:
    """grpcio's client opens with a 64 KiB stream window and 16 KiB frames: a 1 MiB answer waits
    for its WINDOW_UPDATEs and goes out in frames; a 1 MiB request spans many DATA frames."""
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        big = bytes(range(256)) * 4096
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            got = [m async for m in bidi(ch)(gen([big, b"small", big[:70000]]))]
        await server.stop(1)
        assert got == [b"task:" + big, b"task:small", b"task:" + big[:70000]]

    run(go)


def test_many_streams_on_one_connection() -> None:
    rec = Recorder(fast=True)

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            async def one(i: int) -> list[bytes]:
                return [m async for m in bidi(ch)(gen([b"t%d" % i, b"f%d" % i] * 10))]
            results = await asyncio.gather(*(one(i) for i in range(100)))
        assert len(server.connections) == 1
        await server.stop(1)
        for i, got in enumerate(results):
            assert [g.split(b":", 1)[1] for g in got] == [b"t%d" % i, b"f%d" % i] * 10

    run(go)


def test_unary_health_check_over_tls() -> None:
    health = Health()
    cert, key = tls.self_signed()

    async def go() -> None:
        server, port = await serve({CHECK: unary(health.check_wire)}, ssl_context(cert, key))
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                           options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            check = ch.unary_unary(CHECK, request_serializer=HealthCheckRequest.SerializeToString,
                                   response_deserializer=HealthCheckResponse.FromString)
            assert (await check(HealthCheckRequest(service=""), timeout=5)).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await check(HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert list(health.peers)[0].startswith("ipv4:127.0.0.1:")
        await server.stop(1)

    run(go)


def test_unknown_method_is_unimplemented() -> None:
    async def go() -> None:
        server, port = await serve({})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no message: the answer cannot race a write
                [m async for m in bidi(ch)(gen([]))]
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "unknown method /test.Echo/Stream" in (err.value.details() or "")
        await server.stop(1)

    run(go)


def test_a_failing_handler_ends_its_call_with_an_error_and_not_the_others() -> None:
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in bidi(ch)(gen_then_hold([b"a", b"boom"]))]
            assert err.value.code() == grpc.StatusCode.UNKNOWN
            assert [m async for m in bidi(ch)(gen([b"c"]))] == [b"task:c"]
        await server.stop(1)

    rec.fail_on = b"boom"
    run(go)


def test_a_client_cancel_cancels_the_handler() -> None:
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = bidi(ch)()
            await call.write(b"a")
            assert await call.read() == b"task:a"
            call.cancel()
            await eventually_async(lambda: rec.ended == ["cancelled"], 5, "the handler cancelled")
        await server.stop(1)

    run(go)


def test_compressed_messages_are_refused() -> None:
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", compression=grpc.Compression.Gzip) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in bidi(ch)(gen([b"x" * 1000]))]
            assert err.value.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED)
        await server.stop(1)

    run(go)


def test_stop_lets_a_stream_finish_within_grace_and_cancels_after() -> None:
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            finishing = asyncio.ensure_future(_all(bidi(ch)(gen([b"hold", b"x"]))))
            lingering = bidi(ch)()
            await lingering.write(b"a")
            assert await lingering.read() == b"task:a"
            await eventually_async(lambda: b"hold" in rec.seen, 5, "the held stream under way")
            stopping = asyncio.ensure_future(server.stop(1.0))
            await eventually_async(lambda: all(c.shutdown_ping for c in server.connections), 5, "the GOAWAY sent")
            rec.release.set()
            assert await finishing == [b"task:hold", b"task:x"]
            await stopping
            with pytest.raises(grpc.aio.AioRpcError):
                await lingering.read()
        assert sorted(rec.ended) == ["cancelled", "eof"]

    run(go)


async def _all(call: Any) -> list[bytes]:
    return [m async for m in call]


def test_not_http2_is_closed() -> None:
    async def go() -> None:
        server, port = await serve({})
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setblocking(False)
            await loop.sock_sendall(s, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(s, 4096), 5):
                data += chunk
        # its SETTINGS, then a GOAWAY with PROTOCOL_ERROR, then the close
        assert data[3] == SETTINGS
        assert frame(GOAWAY, 0, 0, b"")[3:9] in data and b"preface" in data
        await server.stop(0)

    run(go)


def test_frames_read_a_byte_at_a_time() -> None:
    """A connection whose bytes arrive one by one (preface, SETTINGS, HEADERS, DATA split
    anywhere) is read the same as one that arrives whole."""
    rec = Recorder()

    async def go() -> None:
        server, port = await serve({ECHO: rec.handler()})
        loop = asyncio.get_running_loop()
        enc = __import__("hpack").Encoder()
        block = enc.encode([(":method", "POST"), (":scheme", "http"), (":path", ECHO), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
        msg = b"\x00" + (5).to_bytes(4, "big") + b"hello"
        wire = (PREFACE + frame(SETTINGS, 0, 0)
                + frame(HEADERS, END_HEADERS, 1, block)
                + frame(DATA, END_STREAM, 1, msg))
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(wire)):
                await loop.sock_sendall(s, wire[i:i + 1])
                await asyncio.sleep(0)
            data = b""
            while b"grpc-status" not in data:
                data += await asyncio.wait_for(loop.sock_recv(s, 65536), 5)
        assert b"task:hello" in data
        assert rec.seen == [b"hello"] and rec.ended == ["eof"]
        await server.stop(0)

    run(go)


def frames_in(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame in ``data``."""
    out, i = [], 0
    while i + 9 <= len(data):
        n = int.from_bytes(data[i:i + 3], "big")
        out.append((data[i + 3], data[i + 4], int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF,
                    data[i + 9:i + 9 + n]))
        i += 9 + n
    return out


# What a client's HEADERS for ECHO carry, and one gRPC message of ``body``, framed by hand.
ECHO_HEAD = [(":method", "POST"), (":scheme", "http"), (":path", ECHO), (":authority", "x"),
             ("content-type", "application/grpc"), ("te", "trailers")]


def grpc_msg(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


async def recv_until(s: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    """What ``s`` has sent, read until it holds ``marker`` (on top of ``data``)."""
    loop = asyncio.get_running_loop()
    while marker not in data:
        data += await asyncio.wait_for(loop.sock_recv(s, 65536), 5)
    return data


def test_what_comes_after_the_answer_is_dropped_and_its_window_kept() -> None:
    """Envoy streams a request's body without waiting for the headers' answer: a stream the
    handler has ended (a refusal) is reset after its trailers (NO_ERROR) and gets none of its
    window back, so the peer stops once the window is spent, and what it sent meanwhile
    reaches no handler. A stream still being read gets its window back once half is used."""
    seen: list[bytes] = []

    async def refuse_on_cue(call: Call) -> None:
        while (data := await call.read()) is not None:
            seen.append(data)
            if data == b"refuse":
                call.write(b"refused")
                return

    msg = grpc_msg

    async def go() -> None:
        server, port = await serve({ECHO: streaming(refuse_on_cue)})
        loop = asyncio.get_running_loop()
        block = __import__("hpack").Encoder().encode(ECHO_HEAD)
        big = bytes(STREAM_WINDOW // 2 + 100)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setblocking(False)

            async def until(marker: bytes, data: bytes = b"") -> bytes:
                return await recv_until(s, marker, data)

            await loop.sock_sendall(s, PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block)
                                    + frame(DATA, 0, 1, msg(b"hello")) + frame(DATA, 0, 1, msg(big)))
            await loop.sock_sendall(s, frame(PING, 0, 0, b"ping-one"))
            before = await until(b"ping-one")
            await loop.sock_sendall(s, frame(DATA, 0, 1, msg(b"refuse")))
            answered = await until(b"grpc-status")
            # the rest of the upload, sent on after the answer: most of the window it was given
            after_answer = msg(bytes(STREAM_WINDOW - 1000))
            await loop.sock_sendall(s, frame(DATA, 0, 1, after_answer) + frame(PING, 0, 0, b"ping-two"))
            after = await until(b"ping-two")
        updates = [(f[2], int.from_bytes(f[3], "big")) for f in frames_in(before) if f[0] == WINDOW_UPDATE]
        assert (1, len(msg(b"hello")) + len(msg(big))) in updates, updates
        assert b"refused" in answered
        assert (RST_STREAM, 1, (0).to_bytes(4, "big")) in [(f[0], f[2], f[3]) for f in frames_in(answered)]
        assert not [f for f in frames_in(after) if f[0] == WINDOW_UPDATE and f[2] == 1], frames_in(after)
        assert seen == [b"hello", big, b"refuse"]
        await server.stop(0)

    run(go)


def test_a_stream_its_handler_reads_on_gets_the_window_it_asks_for() -> None:
    """A handler that goes on to read a large body (``Stream.widen``) gives the peer its
    window in one WINDOW_UPDATE up to what it asked, so the body does not come a small
    window per round trip; asking for no more than the window left sends nothing."""
    asked: list[int] = []

    async def read_on(call: Call) -> None:
        while (data := await call.read()) is not None:
            if data.startswith(b"expect:"):
                n = int(data[7:])
                asked.append(n)
                call.st.widen(n)
                call.write(b"ok")

    async def go() -> None:
        server, port = await serve({ECHO: streaming(read_on)})
        loop = asyncio.get_running_loop()
        enc = __import__("hpack").Encoder()
        small, large = grpc_msg(b"expect:1000"), grpc_msg(b"expect:1048576")
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setblocking(False)
            await loop.sock_sendall(s, PREFACE + frame(SETTINGS, 0, 0)
                                    + frame(HEADERS, END_HEADERS, 1, enc.encode(ECHO_HEAD)) + frame(DATA, 0, 1, small)
                                    + frame(HEADERS, END_HEADERS, 3, enc.encode(ECHO_HEAD)) + frame(DATA, 0, 3, large))
            got = b""
            while got.count(b"ok") < 2:
                got += await asyncio.wait_for(loop.sock_recv(s, 65536), 5)
            await loop.sock_sendall(s, frame(PING, 0, 0, b"ping-one"))
            got = await recv_until(s, b"ping-one", got)
        updates = {f[2]: int.from_bytes(f[3], "big") for f in frames_in(got) if f[0] == WINDOW_UPDATE}
        assert asked == [1000, 1048576]
        assert 1 not in updates, updates  # 1,000 more fits in what is left of its window
        assert updates.get(3) == 1048576 - (STREAM_WINDOW - len(large)), updates
        await server.stop(0)

    run(go)
