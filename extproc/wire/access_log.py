"""Envoy's gRPC access log, received: the AccessLogService each Sluice process serves on its
gRPC port, beside the ExternalProcessor (``response_processing: access_log``).

Envoy keeps one stream open per worker and sends its buffered HTTP entries in batches
(``extproc.envoy.access_log``); the entries go to ``sink`` on the event loop, and what they
mean for settling is ``extproc.request.log_settle``'s. A stream that ends (Envoy restarted,
its connection reset) loses nothing here: Envoy opens a new one, and an entry lost on the
way is what the settle's expiry is for.

A batch is settled a slice at a time, one slice per turn of the loop (``SLICE_S`` of work,
at least one entry): a settle costs ~70 µs, and a 20 ms batch at 1,000 requests/s is 20 of
them, so settling it whole held every request that arrived meanwhile for ~1.4 ms (the p99
at one connection, ``bench.overhead``). Each turn also takes at least an eighth of what
waits, so under load the settles keep pace with the requests the turns between them
answer (the backlog settles near 8 turns' worth) instead of falling further behind.
Envoy flushes every 10 ms by default (``gateway.access_log_flush_ms``): the slices of a
smaller batch also take the cores from Envoy and the backend in smaller bursts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.wire.h2grpc.calls import Call, streaming
from extproc.wire.h2grpc.stream import Handler

log = logging.getLogger("sluice.access_log")

Entry = accesslog_pb2.HTTPAccessLogEntry
Sink = Callable[[Sequence[Entry]], None]


SLICE_S = 200e-6


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.queue: deque[Entry] = deque()
        self._scheduled = False

    async def StreamAccessLogs(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            self.receive(message)
        return als_pb2.StreamAccessLogsResponse()

    def receive(self, message: als_pb2.StreamAccessLogsMessage) -> None:
        entries = message.http_logs.log_entry
        if not entries:
            return
        self.queue.extend(entries)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._settle_slice)

    def _settle_slice(self) -> None:
        q = self.queue
        at_least = (len(q) + 7) // 8
        deadline = time.perf_counter() + SLICE_S
        while q:
            self._sink([q.popleft()])
            at_least -= 1
            if at_least <= 0 and time.perf_counter() >= deadline:
                break
        if q:
            asyncio.get_running_loop().call_soon(self._settle_slice)
        else:
            self._scheduled = False

    def _sink(self, entries: Sequence[Entry]) -> None:
        try:
            self.sink(entries)
        except Exception:  # one bad entry must not cost the next ones theirs
            log.exception("access-log batch of %d entries failed", len(entries))

    def h2_handler(self) -> Handler:
        """The same service on ``extproc.wire.h2grpc``: each batch taken in the read callback."""

        def fast(call: Call, data: bytes) -> bool:
            self.receive(als_pb2.StreamAccessLogsMessage.FromString(data))
            return True

        async def run(call: Call) -> None:
            while (data := await call.read()) is not None:
                self.receive(als_pb2.StreamAccessLogsMessage.FromString(data))
            call.write(_EMPTY_RESPONSE)

        return streaming(run, fast)


_EMPTY_RESPONSE = als_pb2.StreamAccessLogsResponse().SerializeToString()
METHOD = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def add_to_server(server: grpc.aio.Server, receiver: AccessLogReceiver) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
