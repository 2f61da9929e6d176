"""Reading a connection: the preface, frames parsed where the socket's bytes land, header
blocks through the connection's HPACK decoder, DATA split into gRPC messages for each
stream's handler, and the control frames (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM)."""

from __future__ import annotations

import asyncio
import logging

import hpack

from extproc.wire.h2grpc.blocks import BlockDecoder
from extproc.wire.h2grpc.frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME_RECV,
    MAX_HEADER_LIST,
    MAX_MESSAGE,
    MAX_STREAMS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    frame,
    pack_goaway,
    pack_setting,
    pack_u32,
    unpack_head_from,
    unpack_setting_from,
    unpack_u32,
)
from extproc.wire.h2grpc.status import INTERNAL, RESOURCE_EXHAUSTED, UNIMPLEMENTED
from extproc.wire.h2grpc.stream import Handler, Sender, Stream

log = logging.getLogger("sluice.h2grpc")


class ConnectionError_(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class Connection(Sender, asyncio.Protocol):
    """One client connection: ``handlers`` maps ``/package.Service/Method`` to what serves
    it; the connection is in ``connections`` while it is open."""

    def __init__(self, handlers: dict[str, Handler], connections: set[Connection]) -> None:
        super().__init__()
        self.handlers, self.connections = handlers, connections
        self.buf = bytearray()  # a partial frame
        self.need = 0  # the bytes ``buf`` must reach before it is worth parsing
        self.preface = False
        self.recv_unacked = 0
        self.decoder = BlockDecoder(MAX_HEADER_LIST)
        self.block: bytearray | None = None  # a header block continued in CONTINUATION frames
        self.block_sid = self.block_flags = 0

    # -- the transport ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        got = transport.get_extra_info("peername")
        if isinstance(got, tuple) and len(got) >= 2:
            self.peer = f"ipv6:[{got[0]}]:{got[1]}" if ":" in str(got[0]) else f"ipv4:{got[0]}:{got[1]}"
        self.connections.add(self)
        settings = b"".join(pack_setting(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (S_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            (S_MAX_FRAME_SIZE, MAX_FRAME_RECV), (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST), (S_ENABLE_PUSH, 0)))
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, pack_u32(CONNECTION_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        streams, self.streams = list(self.streams.values()), {}
        self.blocked.clear()
        for st in streams:
            st.local_closed = True
            self._cancel(st)

    def data_received(self, data: bytes) -> None:
        if self.buf:  # the rest of a frame read in pieces: parse once it is whole
            self.buf += data
            if len(self.buf) < self.need:
                return
            data, self.buf = bytes(self.buf), bytearray()
        if self.out is None:
            self.out = []
        out = self.out  # a task's batch not yet flushed goes first, in order
        try:
            pos = self._frames(data)
        except ConnectionError_ as err:
            log.warning("h2grpc: closing the connection from %s: %s", self.peer, err)
            out.append(frame(GOAWAY, 0, 0, pack_goaway(self.last_sid, err.code) + str(err).encode()[:200]))
            self.flush_out()
            if self.transport is not None:
                self.transport.close()
            return
        if pos < len(data):
            self.buf = bytearray(data[pos:])
            if not self.preface:
                self.need = len(PREFACE)
            else:
                self.need = 9 + int.from_bytes(self.buf[:3], "big") if len(self.buf) >= 9 else 9
        self.flush_out()

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
            hi, lo, kind, flags, sid = unpack_head_from(data, pos)
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
            self.write(frame(WINDOW_UPDATE, 0, 0, pack_u32(self.recv_unacked)))
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid == 0 or sid > self.last_sid:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream this side has reset or finished: what was in flight is dropped
        st.recv_unacked += n
        st.recv_window -= n
        if st.recv_unacked >= STREAM_WINDOW // 2 and not flags & END_STREAM:
            self.write(frame(WINDOW_UPDATE, 0, sid, pack_u32(st.recv_unacked)))
            st.recv_window += st.recv_unacked
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
            headers = self.decoder.decode(block)
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
                self.write(frame(RST_STREAM, 0, sid, pack_u32(STREAM_CLOSED)))
                return
            raise ConnectionError_(PROTOCOL_ERROR, f"stream id {sid} from a client")
        self.last_sid = sid
        if self.going_away:
            self.write(frame(RST_STREAM, 0, sid, pack_u32(REFUSED_STREAM)))
            return
        if len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, sid, pack_u32(REFUSED_STREAM)))
            return
        path = next((v for k, v in headers if k == b":path"), b"").decode("latin-1")
        st = self.streams[sid] = Stream(self, sid, path, list(headers))  # type: ignore[arg-type]
        handler = self.handlers.get(path)
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
        inc = unpack_u32(payload)[0] & 0x7FFFFFFF
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
            key, value = unpack_setting_from(payload, i)
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
