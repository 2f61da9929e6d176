"""Envoy's gRPC access log, received: the AccessLogService each Sluice process serves on its
gRPC port, beside the ExternalProcessor (``response_processing: access_log``).

Envoy keeps one stream open per worker and sends its buffered HTTP entries in batches
(``extproc.envoy.access_log``); each batch goes to ``sink`` as it is, on the event loop,
and what the entries mean for settling is ``extproc.request.log_settle``'s. A stream that
ends (Envoy restarted, its connection reset) loses nothing here: Envoy opens a new one,
and an entry lost on the way is what the settle's expiry is for.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

log = logging.getLogger("sluice.access_log")

Entry = accesslog_pb2.HTTPAccessLogEntry
Sink = Callable[[Sequence[Entry]], None]


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    async def StreamAccessLogs(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            entries = message.http_logs.log_entry
            if not entries:
                continue
            try:
                self.sink(entries)
            except Exception:  # one bad batch must not end the stream the next ones come on
                log.exception("access-log batch of %d entries failed", len(entries))
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(server: grpc.aio.Server, receiver: AccessLogReceiver) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
