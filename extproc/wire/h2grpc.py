"""A gRPC server on the event loop, for the picker's long ext_proc streams: HTTP/2 frames read
and written here, every message handed to its stream in the same callback that read it.

Why not grpcio: under ``FULL_DUPLEX_STREAMED`` a gateway sends every SSE event of every
response to the picker and waits for it back, so the cost per message is the picker's cost
per event. grpc.aio spends ~100 µs of CPU on each (measured, ``bench.echo_stacks``): the C
core reads the frame on its own thread, the completion crosses to the event loop through
a poller thread, and each message is a future, a task step and a batch of C calls. Here a
read of the socket is parsed in Python where it lands: a whole SSE chunk's message goes to
the stream's ``fast`` hook and its echo is written before the callback returns; messages
read together are answered in one write.

What it implements (RFC 9113 as a server, gRPC's HTTP/2 mapping): the preface and SETTINGS
exchange, PING, WINDOW_UPDATE and flow control both ways (each stream's window and the
connection's; data over the peer's window waits), HEADERS with CONTINUATION and padding,
request headers through ``hpack`` (whose decoder keeps the connection's table), DATA carrying
length-prefixed gRPC messages split or joined across frames, RST_STREAM both ways, GOAWAY on
shutdown (the graceful two-step: the maximum id and a PING, then the last id). What it does
not: compressed messages (answered UNIMPLEMENTED), server push, priorities (ignored),
``grpc-timeout`` (Envoy's ext_proc streams carry none the picker could use). Response header
blocks are written as HPACK literals, never indexed, so no encoder state is needed.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol
from urllib.parse import quote

import hpack

log = logging.getLogger("sluice.h2grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
# gRPC status codes used here.
OK, CANCELLED, UNKNOWN, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 1, 2, 8, 12, 13, 14

MAX_WINDOW = (1 << 31) - 1
# What this server lets a peer send ahead: generous (the peer is the gateway's Envoy), and
# returned as soon as half is used, so a stream never stalls on its window.
STREAM_WINDOW = 1 << 24
CONNECTION_WINDOW = 1 << 28
MAX_FRAME_RECV = 1 << 20
MAX_STREAMS = 100000
MAX_MESSAGE = 64 << 20  # as the grpcio servers' max_receive_message_length
MAX_HEADER_LIST = 64 << 10

_FRAME = struct.Struct(">HBBBI")  # 24-bit length as 16 + 8 bits, type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 8, n & 0xFF, kind, flags, sid) + payload


def _hpack_int(n: int, prefix: int, first: int = 0) -> bytes:
    top = (1 << prefix) - 1
    if n < top:
        return bytes((first | n,))
    out = bytearray((first | top,))
    n -= top
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # 0x88: static ":status: 200"


def trailers_block(status: int, message: str = "") -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:  # gRPC's percent-encoding of grpc-message, kept short
        block += _literal(b"grpc-message", quote(message[:512], safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


_TRAILERS_OK = trailers_block(OK)


class App(Protocol):
    """What a stream's handler receives, on the event loop, in the order the peer sent it."""

    def on_message(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...  # the peer half-closed: no more messages

    def on_cancel(self) -> None: ...  # the peer reset the stream, or the connection is gone


Handler = Callable[["Stream"], App]


class Stream:
    """One gRPC call: messages out with ``send``, the status with ``finish``."""

    __slots__ = ("sid", "conn", "path", "headers", "app", "send_window", "pending", "trailers", "headers_sent",
                 "remote_closed", "local_closed", "recv_unacked", "msgbuf")

    def __init__(self, conn: Connection, sid: int, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.sid, self.conn, self.path, self.headers = sid, conn, path, headers
        self.app: App | None = None
        self.send_window = conn.peer_initial_window
        self.pending = bytearray()  # DATA payload waiting for window
        self.trailers: bytes | None = None  # a trailers block waiting for ``pending`` to go out
        self.headers_sent = self.remote_closed = self.local_closed = False
        self.recv_unacked = 0
        self.msgbuf = bytearray()

    @property
    def peer(self) -> str:
        return self.conn.peer

    def send(self, message: bytes) -> None:
        """Queue one gRPC message (written now where the windows allow, else when they open)."""
        if self.local_closed:
            return
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            conn.write(frame(HEADERS, END_HEADERS, self.sid, RESPONSE_HEADERS))
        n = len(message) + 5
        if (not self.pending and n <= self.send_window and n <= conn.send_window
                and n <= conn.max_send_frame):  # the common case: one frame, now
            self.send_window -= n
            conn.send_window -= n
            conn.write(_FRAME.pack(n >> 8, n & 0xFF, DATA, 0, self.sid) + b"\x00" + _U32.pack(n - 5) + message)
            return
        self.pending += b"\x00" + _U32.pack(n - 5) + message
        conn.flush_stream(self)

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with ``status`` (after any data still waiting for window)."""
        if self.local_closed:
            return
        self.local_closed = True
        conn = self.conn
        if not self.headers_sent:  # trailers-only: one HEADERS frame carries both
            self.headers_sent = True
            conn.write(frame(HEADERS, END_HEADERS | END_STREAM, self.sid,
                             RESPONSE_HEADERS + trailers_block(status, message)))
            conn.closed_locally(self)
            return
        self.trailers = _TRAILERS_OK if status == OK and not message else trailers_block(status, message)
        conn.flush_stream(self)


class ConnectionError_(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.buf = bytearray()  # a partial frame
        self.need = 0  # the bytes ``buf`` must reach before it is worth parsing
        self.preface = False
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.max_send_frame = 16384
        self.recv_unacked = 0
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST
        self.block: bytearray | None = None  # a header block continued in CONTINUATION frames
        self.block_sid = self.block_flags = 0
        self.out: list[bytes] | None = None  # frames written while a read is handled, sent together
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for window
        self.going_away = False  # GOAWAY with the last id sent: no new streams
        self.shutdown_ping = False
        self.closed = False

    # -- the transport ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        got = transport.get_extra_info("peername")
        if isinstance(got, tuple) and len(got) >= 2:
            self.peer = f"ipv6:[{got[0]}]:{got[1]}" if ":" in str(got[0]) else f"ipv4:{got[0]}:{got[1]}"
        self.server.connections.add(self)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (S_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            (S_MAX_FRAME_SIZE, MAX_FRAME_RECV), (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST), (S_ENABLE_PUSH, 0)))
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        streams, self.streams = list(self.streams.values()), {}
        self.blocked.clear()
        for st in streams:
            st.local_closed = True
            self._cancel(st)

    def write(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
        elif self.transport is not None and not self.closed:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.buf:  # the rest of a frame read in pieces: parse once it is whole
            self.buf += data
            if len(self.buf) < self.need:
                return
            data, self.buf = bytes(self.buf), bytearray()
        self.out = out = []
        try:
            pos = self._frames(data)
        except ConnectionError_ as err:
            log.warning("h2grpc: closing the connection from %s: %s", self.peer, err)
            out.append(frame(GOAWAY, 0, 0, _GOAWAY.pack(self.last_sid, err.code) + str(err).encode()[:200]))
            self._flush_out()
            if self.transport is not None:
                self.transport.close()
            return
        if pos < len(data):
            self.buf = bytearray(data[pos:])
            if not self.preface:
                self.need = len(PREFACE)
            else:
                self.need = 9 + int.from_bytes(self.buf[:3], "big") if len(self.buf) >= 9 else 9
        self._flush_out()

    def _flush_out(self) -> None:
        out, self.out = self.out, None
        if out and self.transport is not None and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # -- reading frames -----------------------------------------------------------------
    def _frames(self, data: bytes) -> int:
        pos, end = 0, len(data)
        if not self.preface:
            if end < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return 0
            if not data.startswith(PREFACE):
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface = True
            pos = len(PREFACE)
        while end - pos >= 9:
            hi, lo, kind, flags, sid = _FRAME.unpack_from(data, pos)
            n = hi << 8 | lo
            if n > MAX_FRAME_RECV:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {n} bytes")
            if end - pos - 9 < n:
                break
            payload = data[pos + 9:pos + 9 + n]
            pos += 9 + n
            sid &= 0x7FFFFFFF
            if self.block is not None and kind != CONTINUATION:
                raise ConnectionError_(PROTOCOL_ERROR, "a header block interrupted")
            if kind == DATA:
                self._data(sid, flags, payload, n)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload)
            elif kind == PING:
                self._ping(sid, flags, payload)
            elif kind == RST_STREAM:
                self._rst(sid, payload)
            elif kind == GOAWAY:
                pass  # the peer opens no more streams; those under way finish
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)
        return pos

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
        return payload[1:len(payload) - payload[0]]

    def _data(self, sid: int, flags: int, payload: bytes, n: int) -> None:
        self.recv_unacked += n
        if self.recv_unacked >= CONNECTION_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid == 0 or sid > self.last_sid:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream this side has reset or finished: what was in flight is dropped
        st.recv_unacked += n
        if st.recv_unacked >= STREAM_WINDOW // 2 and not flags & END_STREAM:
            self.write(frame(WINDOW_UPDATE, 0, sid, _U32.pack(st.recv_unacked)))
            st.recv_unacked = 0
        if flags & PADDED:
            payload = self._unpad(flags, payload)
        app = st.app
        buf = st.msgbuf
        if (not buf and len(payload) > 4 and payload[0] == 0
                and int.from_bytes(payload[1:5], "big") == len(payload) - 5):  # one whole message
            if app is not None and not st.local_closed:
                app.on_message(payload[5:])
        elif payload:
            buf += payload
            while len(buf) >= 5:
                m = int.from_bytes(buf[1:5], "big")
                if buf[0] != 0 or m > MAX_MESSAGE:
                    self.reset(st, CANCEL)
                    st.finish(UNIMPLEMENTED if buf[0] != 0 else RESOURCE_EXHAUSTED,
                              "compressed messages are not accepted" if buf[0] != 0 else "message too large")
                    return
                if len(buf) < 5 + m:
                    break
                msg = bytes(buf[5:5 + m])
                del buf[:5 + m]
                if app is not None and not st.local_closed:
                    app.on_message(msg)
        if flags & END_STREAM and sid in self.streams:
            st.remote_closed = True
            if app is not None:
                app.on_end()
            if st.local_closed and not st.pending and st.trailers is None:
                self.streams.pop(sid, None)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, payload)
        else:
            self.block, self.block_sid, self.block_flags = bytearray(payload), sid, flags

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if self.block is None or sid != self.block_sid:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION out of place")
        self.block += payload
        if len(self.block) > MAX_HEADER_LIST * 2:
            raise ConnectionError_(PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            block, self.block = bytes(self.block), None
            self._header_block(sid, self.block_flags, block)

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        try:  # every block goes through the decoder, whatever its stream: it keeps the table
            headers = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as err:
            raise ConnectionError_(COMPRESSION_ERROR, f"HPACK: {err}") from err
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client: the end of its messages
            if not flags & END_STREAM:
                raise ConnectionError_(PROTOCOL_ERROR, "a second header block without END_STREAM")
            st.remote_closed = True
            if st.app is not None:
                st.app.on_end()
            return
        if sid % 2 == 0 or sid <= self.last_sid:
            if sid <= self.last_sid:
                self.write(frame(RST_STREAM, 0, sid, _U32.pack(STREAM_CLOSED)))
                return
            raise ConnectionError_(PROTOCOL_ERROR, f"stream id {sid} from a client")
        self.last_sid = sid
        if self.going_away:
            self.write(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        if len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        path = next((v for k, v in headers if k == b":path"), b"").decode("latin-1")
        st = self.streams[sid] = Stream(self, sid, path, list(headers))  # type: ignore[arg-type]
        handler = self.server.handlers.get(path)
        if handler is None:
            st.finish(UNIMPLEMENTED, f"unknown method {path}")
        else:
            try:
                st.app = handler(st)
            except Exception:
                log.exception("h2grpc: handler for %s failed to start", path)
                st.finish(INTERNAL, "handler failed to start")
        if flags & END_STREAM:
            st.remote_closed = True
            if st.app is not None:
                st.app.on_end()
            if st.local_closed and not st.pending and st.trailers is None:
                self.streams.pop(sid, None)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            for st in list(self.blocked.values()):
                self.flush_stream(st)
                if self.send_window <= 0:
                    break
            return
        st = self.streams.get(sid)
        if st is None:
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            self.reset(st, FLOW_CONTROL_ERROR)
            return
        self.flush_stream(st)

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for st in self.streams.values():
                    st.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self.max_send_frame = value
            # the peer's header table size binds an encoder that indexes: this one never does
        self.write(frame(SETTINGS, ACK, 0))
        if self.blocked:
            for st in list(self.blocked.values()):
                self.flush_stream(st)

    def _ping(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0 or len(payload) != 8:
            raise ConnectionError_(PROTOCOL_ERROR, "bad PING")
        if not flags & ACK:
            self.write(frame(PING, ACK, 0, payload))
        elif payload == b"shutdown" and self.shutdown_ping:
            self._go_away()

    def _rst(self, sid: int, payload: bytes) -> None:
        st = self.streams.pop(sid, None)
        self.blocked.pop(sid, None)
        if st is not None:
            st.remote_closed = st.local_closed = True
            self._cancel(st)

    # -- writing ------------------------------------------------------------------------
    def flush_stream(self, st: Stream) -> None:
        """Send what ``st`` has waiting, as far as both windows allow; then its trailers."""
        pending = st.pending
        while pending:
            room = min(st.send_window, self.send_window, self.max_send_frame, len(pending))
            if room <= 0:
                self.blocked[st.sid] = st
                return
            chunk = bytes(pending[:room])
            del pending[:room]
            st.send_window -= room
            self.send_window -= room
            self.write(frame(DATA, 0, st.sid, chunk))
        self.blocked.pop(st.sid, None)
        if st.trailers is not None:
            block, st.trailers = st.trailers, None
            self.write(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, block))
            self.closed_locally(st)

    def closed_locally(self, st: Stream) -> None:
        """The server's half is done: forget the stream, and stop the client's half if it is
        still open (gRPC's HTTP/2 mapping: RST_STREAM NO_ERROR after the trailers)."""
        if self.streams.pop(st.sid, None) is None:
            return
        if not st.remote_closed:
            st.remote_closed = True
            self.write(frame(RST_STREAM, 0, st.sid, _U32.pack(NO_ERROR)))
        if self.going_away and not self.streams and self.transport is not None:
            self._flush_if_idle()

    def _flush_if_idle(self) -> None:
        if self.out is None and self.transport is not None:
            self.transport.close()
        elif self.transport is not None:
            asyncio.get_running_loop().call_soon(self.transport.close)

    def reset(self, st: Stream, code: int) -> None:
        self.streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)
        st.local_closed = st.remote_closed = True
        self.write(frame(RST_STREAM, 0, st.sid, _U32.pack(code)))
        self._cancel(st)

    @staticmethod
    def _cancel(st: Stream) -> None:
        if st.app is not None:
            try:
                st.app.on_cancel()
            except Exception:
                log.exception("h2grpc: cancelling a stream failed")

    # -- shutting down ------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """GOAWAY with the largest id, then a PING: streams the peer opened before it saw the
        GOAWAY still land; the final GOAWAY (the last id) follows the PING's answer."""
        if self.closed or self.shutdown_ping:
            return
        self.shutdown_ping = True
        self.write(frame(GOAWAY, 0, 0, _GOAWAY.pack(MAX_WINDOW, NO_ERROR)) + frame(PING, 0, 0, b"shutdown"))

    def _go_away(self) -> None:
        if self.going_away or self.closed:
            return
        self.going_away = True
        self.write(frame(GOAWAY, 0, 0, _GOAWAY.pack(self.last_sid, NO_ERROR)))
        if not self.streams:
            self._flush_if_idle()

    def abort(self) -> None:
        """Cancel what is still running and close."""
        self._go_away()
        for st in list(self.streams.values()):
            self.reset(st, CANCEL)
        if self.transport is not None and not self.closed:
            self.transport.close()


class Server:
    """gRPC methods (``/package.Service/Method`` -> handler) on one listening socket."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, ssl=ssl_context,
                                                reuse_port=reuse_port or None, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Stop listening; let the streams under way finish within ``grace``; cancel the rest."""
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c.streams for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c.abort()
        await asyncio.sleep(0)


def ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS server context offering h2 (Envoy's upstream TLS connects with or without ALPN)."""
    import os
    import tempfile

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    fd, path = tempfile.mkstemp(prefix="sluice-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key_pem + b"\n" + cert_pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx


# -- handlers ------------------------------------------------------------------------------

class Unary:
    """A unary method: ``fn(request bytes, peer)`` -> (status, response bytes or None, message)."""

    def __init__(self, st: Stream, fn: Callable[[bytes, str], tuple[int, bytes | None, str]]) -> None:
        self.st, self.fn = st, fn
        self.request: bytes | None = None

    def on_message(self, data: bytes) -> None:
        if self.request is None:
            self.request = data

    def on_end(self) -> None:
        try:
            status, body, message = self.fn(self.request or b"", self.st.peer)
        except Exception:
            log.exception("h2grpc: unary %s failed", self.st.path)
            status, body, message = INTERNAL, None, "internal error"
        if body is not None:
            self.st.send(body)
        self.st.finish(status, message)

    def on_cancel(self) -> None:
        pass


def unary(fn: Callable[[bytes, str], tuple[int, bytes | None, str]]) -> Handler:
    return lambda st: Unary(st, fn)


class Call:
    """A streaming method run as a task, like grpc.aio's ``context.read()``/``write()``:
    ``read()`` is the next message (None once the peer half-closed), ``write()`` queues one.

    ``fast``, when given, sees each message first while the task is parked in ``read()`` with
    nothing queued; returning True means it was handled there and then (its answer already
    written), so the task is not woken for it. It must do exactly what the task would."""

    __slots__ = ("st", "q", "waiter", "ended", "task", "fast")

    def __init__(self, st: Stream, run: Callable[[Call], Awaitable[None]],
                 fast: Callable[[Call, bytes], bool] | None = None) -> None:
        self.st = st
        self.q: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.fast = fast
        self.task = asyncio.get_running_loop().create_task(self._run(run))

    @property
    def peer(self) -> str:
        return self.st.peer

    async def _run(self, run: Callable[[Call], Awaitable[None]]) -> None:
        try:
            await run(self)
        except asyncio.CancelledError:
            self.st.finish(CANCELLED, "cancelled")
            return
        except Exception as exc:  # the handler logs what it must; the peer gets the status
            self.st.finish(UNKNOWN, f"{type(exc).__name__}")
            return
        self.st.finish(OK)

    def on_message(self, data: bytes) -> None:
        if self.fast is not None and self.waiter is not None and not self.q:
            try:
                if self.fast(self, data):
                    return
            except Exception:
                self.fast = None
                self.task.cancel()
                self.st.finish(UNKNOWN, "handler failed")
                return
        self.q.append(data)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_end(self) -> None:
        self.ended = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_cancel(self) -> None:
        self.ended = True
        self.task.cancel()

    async def read(self) -> bytes | None:
        while not self.q:
            if self.ended:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.q.popleft()

    def write(self, message: bytes) -> None:
        self.st.send(message)


def streaming(run: Callable[[Call], Awaitable[None]], fast: Callable[[Call, bytes], bool] | None = None) -> Handler:
    return lambda st: Call(st, run, fast)


__all__ = ["App", "Call", "Handler", "Server", "Stream", "Unary", "frame", "ssl_context", "streaming",
           "trailers_block", "unary"]
