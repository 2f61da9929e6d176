"""Protobuf wire form written by hand, for the few messages written once per request or chunk.

The upb classes cost ~1 µs per field set (each a C call and an object); an answer that
names a dozen headers and metadata values costs ~25 µs to build and 3 more to serialize.
Written as bytes, the parts that repeat (a header pair, a mode) are encoded once, and the
rest is joined. Only what ext_proc answers need: varints, length-delimited fields.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VARINTS = [varint(i) for i in range(1 << 14)]  # every length up to 16 KiB, written once


def length(n: int) -> bytes:
    """A length prefix (a varint, from the table below 16 KiB)."""
    return _VARINTS[n] if n < 16384 else varint(n)


def tag(field: int) -> bytes:
    """The key of a length-delimited field (wire type 2)."""
    return varint(field << 3 | 2)


def delimited(key: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its key (``tag(field)``), its length, the payload."""
    return b"".join((key, length(len(payload)), payload))


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i]`` and the index past it (IndexError when cut short)."""
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
