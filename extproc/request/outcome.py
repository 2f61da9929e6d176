"""What settle needs to know of a response, whichever way it was learned.

A request's response side reaches Sluice in one of several ways: Envoy's gRPC access log
(``response_processing: access_log``), the response headers and usage trailers
(``usage_trailers``), every body chunk (``streamed``, and the Responses API), or a
gateway's full-duplex stream (the endpoint picker). Each is mapped into one
``ResponseOutcome``, which ``Settlement.settle_with`` applies before the one settle.

Times are seconds after the request's start (Envoy's, which is within a few µs of the
ext_proc stream's start, ``Settlement.arrived_s``), so an outcome that arrives late (the
access log is batched) still says when the first byte came and when the response ended.
"""

from __future__ import annotations

from typing import NamedTuple

from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.envoy import usage_record
from extproc.envoy.headers import SETTLE_KEY
from extproc.envoy.usage_record import EnvoyUsage
from extproc.policy.reasons import Ending
from extproc.wire.messages import METADATA_NAMESPACE

# How a stream ended (``Settlement.settle``'s ``how``): a response ended (whatever its
# status), or it stopped before its end, which says nothing about the backend.
END_OF_STREAM, DISCONNECT = Ending.END_OF_STREAM, Ending.DISCONNECT


class ResponseOutcome(NamedTuple):
    how: Ending  # END_OF_STREAM or DISCONNECT
    status: int  # the HTTP status sent to the client; 0 when none was
    first_byte_after_s: float | None  # the first response byte from upstream
    ended_after_s: float | None  # the last byte sent to the client
    served: str | None  # the ip:port that served, when an upstream did
    usage: EnvoyUsage | None  # Envoy's usage record, when it read one
    sse: bool  # the response was a server-sent event stream


def _seconds(common: accesslog_pb2.AccessLogCommon, name: str) -> float | None:
    if not common.HasField(name):
        return None
    d = getattr(common, name)
    return d.seconds + d.nanos / 1e9


def _usage(common: accesslog_pb2.AccessLogCommon) -> EnvoyUsage | None:
    packed = common.metadata.typed_filter_metadata.get(usage_record.USAGE_NAMESPACE)
    return None if packed is None else usage_record.usage_from_any(packed)


def _cut_short(flags: accesslog_pb2.ResponseFlags) -> bool:
    """The response stopped before its end: the client left, or the upstream reset or
    closed mid-response (with a complete response no flag is set). A refused connection
    or a timeout ends with Envoy's own reply, a status of its own (503, 504)."""
    return (flags.downstream_connection_termination or flags.downstream_remote_reset
            or flags.upstream_remote_reset or flags.upstream_connection_termination)


def settle_id(entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
    """The ``sluice.settle`` key Sluice wrote into the request's metadata, if any."""
    ours = entry.common_properties.metadata.filter_metadata.get(METADATA_NAMESPACE)
    if ours is None:
        return None
    value = ours.fields.get(SETTLE_KEY)
    return None if value is None else value.string_value


def from_log_entry(entry: accesslog_pb2.HTTPAccessLogEntry) -> ResponseOutcome:
    """The outcome an access-log entry (``extproc.envoy.access_log``) tells."""
    common = entry.common_properties
    status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    address = common.upstream_remote_address.socket_address
    served = f"{address.address}:{address.port_value}" if address.address else None
    ended = _seconds(common, "time_to_last_downstream_tx_byte")
    return ResponseOutcome(
        how=DISCONNECT if status == 0 or _cut_short(common.response_flags) else END_OF_STREAM,
        status=status,
        first_byte_after_s=_seconds(common, "time_to_first_upstream_rx_byte") if status else None,
        ended_after_s=ended if ended is not None else _seconds(common, "duration"),
        served=served,
        usage=_usage(common),
        sse="text/event-stream" in entry.response.response_headers.get("content-type", ""),
    )
