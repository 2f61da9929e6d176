"""A connection's HPACK decoder that remembers the header blocks which leave its table alone.

Envoy opens every ext_proc stream with the same 46-byte block: ``:path`` and ``:authority``
as literals it never indexes (Huffman-coded, so decoded again each time) and two entries of
the dynamic table by index. The ``hpack`` library decodes it in ~30 µs warm and 100–180 µs
on a process that idles between requests, the largest part of reading a stream's first
message (measured in the demo's stack). A block that did not change the dynamic table
decodes to the same headers for as long as the table stays as it was, so its headers are
kept with the table they were decoded against and handed out again while it still is.
"""

from __future__ import annotations

import hpack

Headers = list[tuple[bytes, bytes]]
KEEP = 64  # blocks remembered; a peer that sends more distinct ones only costs a decode each


class BlockDecoder:
    __slots__ = ("decoder", "known")

    def __init__(self, max_header_list_size: int) -> None:
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = max_header_list_size
        self.known: dict[bytes, tuple[tuple[object, ...], int, Headers]] = {}

    def decode(self, block: bytes) -> Headers:
        """The block's headers (raises ``hpack.HPACKError`` as the library does)."""
        table = self.decoder.header_table
        entries, size = tuple(table.dynamic_entries), table.maxsize
        got = self.known.get(block)
        if got is not None and got[1] == size and got[0] == entries:
            return got[2]
        headers: Headers = self.decoder.decode(block, raw=True)  # type: ignore[assignment]
        if table.maxsize == size and tuple(table.dynamic_entries) == entries:
            if len(self.known) >= KEEP:
                self.known.clear()
            self.known[block] = (entries, size, headers)
        return headers
