"""gRPC statuses, and the response header blocks that carry them: written as HPACK literals,
never indexed, so the server keeps no encoder state."""

from __future__ import annotations

from urllib.parse import quote

# gRPC status codes used here.
OK, CANCELLED, UNKNOWN, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 1, 2, 8, 12, 13, 14


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


TRAILERS_OK = trailers_block(OK)
