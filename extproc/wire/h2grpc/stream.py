"""What goes out: one gRPC call's messages and status (``Stream``), and the connection's
sending half under it (``Sender``): both flow-control windows, frames written while a read
is handled sent together, resets, and the two-step GOAWAY. ``connection.Connection`` adds
the reading half on top."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from extproc.wire.h2grpc.frames import (
    CANCEL,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    RST_STREAM,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    frame,
    pack_goaway,
    pack_head,
    pack_u32,
)
from extproc.wire.h2grpc.status import OK, RESPONSE_HEADERS, TRAILERS_OK, trailers_block

log = logging.getLogger("sluice.h2grpc")


class App(Protocol):
    """What a stream's handler receives, on the event loop, in the order the peer sent it."""

    def on_message(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...  # the peer half-closed: no more messages

    def on_cancel(self) -> None: ...  # the peer reset the stream, or the connection is gone


Handler = Callable[["Stream"], App]


class Stream:
    """One gRPC call: messages out with ``send``, the status with ``finish``."""

    __slots__ = ("sid", "conn", "path", "headers", "app", "send_window", "pending", "trailers", "headers_sent",
                 "remote_closed", "local_closed", "recv_unacked", "recv_window", "msgbuf")

    def __init__(self, conn: Sender, sid: int, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.sid, self.conn, self.path, self.headers = sid, conn, path, headers
        self.app: App | None = None
        self.send_window = conn.peer_initial_window
        self.pending = bytearray()  # DATA payload waiting for window
        self.trailers: bytes | None = None  # a trailers block waiting for ``pending`` to go out
        self.headers_sent = self.remote_closed = self.local_closed = False
        self.recv_unacked = 0  # bytes read and not yet given back to the peer's window
        self.recv_window = STREAM_WINDOW  # what the peer may still send on this stream
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
            conn.write(pack_head(n >> 8, n & 0xFF, DATA, 0, self.sid) + b"\x00" + pack_u32(n - 5) + message)
            return
        self.pending += b"\x00" + pack_u32(n - 5) + message
        conn.flush_stream(self)

    def widen(self, ahead: int) -> None:
        """Let the peer send ``ahead`` bytes on this stream without waiting for more window.

        The first window is small so that a stream ended from its first message has little
        of the rest sent; a handler that goes on to read a known amount says so here, and
        the rest comes in one go instead of a window's worth per round trip."""
        ahead = min(ahead, MAX_WINDOW)
        if self.local_closed or self.remote_closed or ahead <= self.recv_window:
            return
        self.conn.write(frame(WINDOW_UPDATE, 0, self.sid, pack_u32(ahead - self.recv_window)))
        self.recv_window = ahead

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
        self.trailers = TRAILERS_OK if status == OK and not message else trailers_block(status, message)
        conn.flush_stream(self)


class Sender:
    """A connection's streams and its sending half. ``write`` batches into ``out``: while a
    read is handled (``Connection.data_received`` sends the batch in one write), and from a
    task, until the loop's next turn. A stream's task answers several messages in one step
    (the request headers' deferred answer, then each body chunk's); one write of them all
    wakes the peer once instead of once per frame."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.max_send_frame = 16384
        self.out: list[bytes] | None = None  # frames written while a read is handled, sent together
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for window
        self.going_away = False  # GOAWAY with the last id sent: no new streams
        self.shutdown_ping = False
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
        elif self.transport is not None and not self.closed:
            self.out = [data]
            asyncio.get_running_loop().call_soon(self.flush_out)

    def flush_out(self) -> None:
        out, self.out = self.out, None
        if out and self.transport is not None and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

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
            self.write(frame(RST_STREAM, 0, st.sid, pack_u32(NO_ERROR)))
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
        self.write(frame(RST_STREAM, 0, st.sid, pack_u32(code)))
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
        self.write(frame(GOAWAY, 0, 0, pack_goaway(MAX_WINDOW, NO_ERROR)) + frame(PING, 0, 0, b"shutdown"))

    def _go_away(self) -> None:
        if self.going_away or self.closed:
            return
        self.going_away = True
        self.write(frame(GOAWAY, 0, 0, pack_goaway(self.last_sid, NO_ERROR)))
        if not self.streams:
            self._flush_if_idle()

    def abort(self) -> None:
        """Cancel what is still running and close."""
        self._go_away()
        for st in list(self.streams.values()):
            self.reset(st, CANCEL)
        self.flush_out()
        if self.transport is not None and not self.closed:
            self.transport.close()
