"""Reading Envoy's side of an ext_proc stream, with a look-ahead while we hold a reply.

While a request waits in the admission queue, no message is expected from Envoy;
if the stream ends anyway, the client has gone and the wait must stop. Reading
ahead only then keeps the common path to a plain ``__anext__``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.wire.h2grpc.calls import Call, Messages


class PeerStream:
    def __init__(self, iterator: AsyncIterator[pb.ProcessingRequest],
                 widen: Callable[[int], None] | None = None) -> None:
        self._it = iterator
        self._ahead: asyncio.Future[pb.ProcessingRequest | None] | None = None
        self._widen = widen

    def expect(self, ahead: int) -> None:
        """About ``ahead`` bytes of messages are coming and will be read: a transport that
        holds the peer to a small window (extproc.wire.h2grpc) lets them all come at once."""
        if self._widen is not None and ahead > 0:
            self._widen(ahead)

    async def _read(self) -> pb.ProcessingRequest | None:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None

    async def next(self) -> pb.ProcessingRequest | None:
        """The next message, or None once Envoy has closed its side."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return await ahead
        return await self._read()

    def closed_signal(self) -> asyncio.Future[pb.ProcessingRequest | None]:
        """A future that completes when Envoy sends anything (or closes) — start reading ahead."""
        if self._ahead is None:
            self._ahead = asyncio.ensure_future(self._read())
        return self._ahead

    def cancel(self) -> None:
        if self._ahead is not None and not self._ahead.done():
            self._ahead.cancel()


def h2_peer(call: Call) -> PeerStream:
    """An ext_proc call on extproc.wire.h2grpc: its messages, parsed, and its stream's
    window to open for a body that will be read."""
    return PeerStream(Messages(call, pb.ProcessingRequest.FromString), call.st.widen)
