"""The HPACK decoder that hands out again a block which left its table alone: the same
headers as the library's own decoder, block for block, whatever the table does between."""

from __future__ import annotations

import random

import hpack
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from extproc.wire.h2grpc.blocks import KEEP, BlockDecoder

ENVOY_LIKE = [(b":method", b"POST"), (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
              (b":authority", b"sluice_extproc"), (b":scheme", b"http"), (b"te", b"trailers"),
              (b"content-type", b"application/grpc")]


def never_indexed(headers: list[tuple[bytes, bytes]]) -> list[NeverIndexedHeaderTuple]:
    return [NeverIndexedHeaderTuple(k, v) for k, v in headers]


class Counting(BlockDecoder):
    """Counts the blocks the library itself decoded."""

    def __init__(self) -> None:
        super().__init__(1 << 16)
        self.decoded = 0
        inner = self.decoder.decode

        def counted(block, raw=False):  # type: ignore[no-untyped-def]
            self.decoded += 1
            return inner(block, raw=raw)

        self.decoder.decode = counted  # type: ignore[method-assign]


def test_a_block_that_leaves_the_table_alone_is_decoded_once() -> None:
    enc, ours = hpack.Encoder(), Counting()
    ours.decode(enc.encode([(b"x-envoy-internal", b"true")]))  # an entry in the table, referenced below
    block = enc.encode([*never_indexed(ENVOY_LIKE), HeaderTuple(b"x-envoy-internal", b"true")])
    first = ours.decode(block)
    for _ in range(5):
        assert ours.decode(block) == first
    assert ours.decoded == 2
    assert dict(first)[b":path"].endswith(b"/Process")


def test_a_changed_table_decodes_the_same_bytes_again() -> None:
    enc, ours, ref = hpack.Encoder(), Counting(), hpack.Decoder()
    ours.decode(b := enc.encode([(b"x-a", b"1")]))
    ref.decode(b, raw=True)
    indexed = enc.encode([(b"x-a", b"1")])  # one byte: dynamic index 62
    assert ours.decode(indexed) == ref.decode(indexed, raw=True) == [(b"x-a", b"1")]
    # A new entry shifts x-a to index 63: the same byte now names the new one.
    new = enc.encode([(b"x-b", b"2")])
    assert ours.decode(new) == ref.decode(new, raw=True)
    assert ours.decode(indexed) == ref.decode(indexed, raw=True) == [(b"x-b", b"2")]
    assert ours.decoded == 4


def test_random_sequences_match_the_library() -> None:
    rng = random.Random(7)
    names = [b"x-request-id", b"x-envoy-internal", b"x-forwarded-for", b"grpc-timeout", b"user-agent"]
    for _ in range(20):
        enc, ours, ref = hpack.Encoder(), BlockDecoder(1 << 16), hpack.Decoder()
        enc.header_table_size = rng.choice([256, 4096])
        sent: list[list[object]] = []
        hits = 0
        for _ in range(80):
            if sent and rng.random() < 0.4:
                hs = sent[rng.randrange(len(sent))]  # the same headers again: often the same bytes
            else:
                hs = list(never_indexed(ENVOY_LIKE)) if rng.random() < 0.5 else list(ENVOY_LIKE)
                for n in rng.sample(names, rng.randint(0, 3)):
                    v = str(rng.randint(0, 3 if rng.random() < 0.7 else 10**6)).encode()
                    hs.append(NeverIndexedHeaderTuple(n, v) if rng.random() < 0.3 else (n, v))
                sent.append(hs)
            b = enc.encode(hs)
            hits += b in ours.known
            assert ours.decode(b) == ref.decode(b, raw=True)
        assert hits > 0  # the remembered path was taken, and agreed


def test_what_is_remembered_is_bounded() -> None:
    enc, ours = hpack.Encoder(), BlockDecoder(1 << 16)
    for i in range(KEEP * 3):
        ours.decode(enc.encode(never_indexed([*ENVOY_LIKE, (b"x-n", str(i).encode())])))
    assert len(ours.known) <= KEEP
