"""HTTP/2's frame layout and codes (RFC 9113), and what this server lets a peer send."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
# What this server lets a peer send ahead on one stream, returned as soon as half is used,
# so a stream being read never stalls on it. Small on purpose: Envoy streams the request
# body without waiting for the headers' answer, so with a large window a request refused
# from its headers (a spent budget) has its whole upload sent on anyway, a MiB of junk per
# refusal for Python to read. An answered stream is reset (RST_STREAM NO_ERROR after its
# trailers, stream.py) and gets no window back, so at most about this much of it comes.
# 128 KiB: a small body, and a 128 KiB prompt but for its last bytes, fit in the first window;
# a handler that reads on opens the window to the body it expects (Stream.widen).
STREAM_WINDOW = 1 << 17
CONNECTION_WINDOW = 1 << 28
MAX_FRAME_RECV = 1 << 20
MAX_STREAMS = 100000
MAX_MESSAGE = 64 << 20  # as the grpcio servers' max_receive_message_length
MAX_HEADER_LIST = 64 << 10

_HEAD = struct.Struct(">HBBBI")  # 24-bit length as 16 + 8 bits, type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
# The packers bound once, so a call in the modules that import them is one global load:
# CPython compiles a method call on an imported name (``U32.pack(...)``) as an attribute
# load making a bound method each time: 5-8% more CPU per message on the read-and-echo path.
pack_head, unpack_head_from = _HEAD.pack, _HEAD.unpack_from
pack_u32, unpack_u32 = _U32.pack, _U32.unpack
pack_setting, unpack_setting_from = _SETTING.pack, _SETTING.unpack_from
pack_goaway = struct.Struct(">II").pack  # last stream id, error code


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return pack_head(n >> 8, n & 0xFF, kind, flags, sid) + payload
