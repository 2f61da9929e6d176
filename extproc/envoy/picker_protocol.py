"""The Inference Extension endpoint picker protocol, as gateways speak it to Sluice.

The protocol (``docs/proposals/004-endpoint-picker-protocol`` in
kubernetes-sigs/gateway-api-inference-extension): the picker names the endpoint in the
request header ``x-gateway-destination-endpoint`` **and** in dynamic metadata
``envoy.lb`` / ``x-gateway-destination-endpoint`` (the same value in both: ``ip:port``, or an
ordered list ``ip:port,ip:port``); the gateway may restrict the choice with a subset hint
(``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``, a list) and reports
who served in ``metadata_context`` (``envoy.lb`` / ``x-gateway-destination-endpoint-served``).

Which gateways read what (their sources, and Envoy 1.40 on this machine): GIE's and
llm-d-router's reference Envoys and Envoy AI Gateway route with an ``ORIGINAL_DST`` cluster
on the header, which takes exactly one address (a list answers 503 "no healthy upstream");
they accept no dynamic metadata and forward none. Istio's ``override_host`` policy reads the
metadata only, honours the list in order, and writes the served host back.

Under ``FULL_DUPLEX_STREAMED`` every body chunk must be sent back as a ``streamed_response``.
The echo of a chunk is the one message per SSE event, so it is written here as protobuf
wire bytes around the chunk (the gRPC serializer passes bytes through), not built as
five nested messages.
"""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.wire.pbwire import length, read_varint, tag

NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
# Some Envoy builds cap a streamed chunk at 64 KiB; llm-d-router's picker cuts at 62,000.
MAX_CHUNK = 62000

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED_MODES = frozenset({processing_mode_pb2.ProcessingMode.BUFFERED,
                            processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL})
NONE = processing_mode_pb2.ProcessingMode.NONE
# ProcessingResponse fields (external_processor.proto): the direction of a body answer.
REQUEST_BODY_FIELD, RESPONSE_BODY_FIELD = 3, 4

_EOS = b"\x10\x01"  # StreamedBodyResponse.end_of_stream = true
_FIELD_TAGS = {REQUEST_BODY_FIELD: tag(REQUEST_BODY_FIELD), RESPONSE_BODY_FIELD: tag(RESPONSE_BODY_FIELD)}


def echo(field: int, chunk: bytes, end_of_stream: bool) -> bytes:
    """``ProcessingResponse{<field>: BodyResponse{response: CommonResponse{body_mutation:
    BodyMutation{streamed_response: StreamedBodyResponse{body, end_of_stream}}}}}`` as bytes."""
    n = len(chunk)
    body_len = length(n) if n else b""
    inner = (1 + len(body_len) + n if n else 0) + (2 if end_of_stream else 0)
    inner_v = length(inner)
    streamed = 1 + len(inner_v) + inner  # BodyMutation.streamed_response = 3
    streamed_v = length(streamed)
    mutation = 1 + len(streamed_v) + streamed  # CommonResponse.body_mutation = 3
    mutation_v = length(mutation)
    common = 1 + len(mutation_v) + mutation  # BodyResponse.response = 1
    return b"".join((_FIELD_TAGS[field], length(common), b"\x0a", mutation_v, b"\x1a", streamed_v, b"\x1a", inner_v,
                     b"\x0a" if n else b"", body_len, chunk, _EOS if end_of_stream else b""))


_RESPONSE_BODY_TAG = 5 << 3 | 2  # ProcessingRequest.response_body, length-delimited


_EMPTY_METADATA = b"\x42\x00"  # ProcessingRequest.metadata_context, empty: Envoy 1.40 sends it on every message


def response_chunk(data: bytes) -> tuple[bytes, bool] | None:
    """``(body, end_of_stream)`` of a ProcessingRequest in wire form that holds a
    ``response_body`` with at most those two fields, and else only an empty
    ``metadata_context`` (what Envoy sends for each streamed chunk); None for any other
    message, which is parsed whole instead."""
    if len(data) < 2 or data[0] != _RESPONSE_BODY_TAG:
        return None
    try:
        n, i = read_varint(data, 1)
        if i + n != len(data):
            if i + n != len(data) - 2 or not data.endswith(_EMPTY_METADATA):
                return None
            data = data[:-2]
        body, eos = b"", False
        if i < len(data) and data[i] == 0x0A:  # HttpBody.body
            m, i = read_varint(data, i + 1)
            body, i = data[i:i + m], i + m
        if i < len(data) and data[i] == 0x10:  # HttpBody.end_of_stream
            eos, i = data[i + 1] == 1, i + 2
    except IndexError:
        return None
    return (body, eos) if i == len(data) else None


def echo_all(field: int, body: bytes, end_of_stream: bool) -> list[bytes]:
    """A whole body sent back in chunks of at most ``MAX_CHUNK``; the last one ends the stream."""
    if not body:
        return [echo(field, b"", end_of_stream)]
    cuts = range(0, len(body), MAX_CHUNK)
    return [echo(field, body[i:i + MAX_CHUNK], end_of_stream and i + MAX_CHUNK >= len(body)) for i in cuts]


def body_modes(request: pb.ProcessingRequest) -> tuple[int, int] | None:
    """The (request, response) body modes the gateway configured, from the stream's first
    message (Envoy sends ``protocol_config`` there); None when it says nothing."""
    if not request.HasField("protocol_config"):
        return None
    pc = request.protocol_config
    return pc.request_body_mode, pc.response_body_mode


def _lb_field(request: pb.ProcessingRequest, namespace: str, key: str) -> object | None:
    md = request.metadata_context.filter_metadata
    if namespace not in md:
        return None
    value = md[namespace].fields.get(key)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    return None


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway lets the picker choose from, or None (no hint: the whole pool).

    An empty hint is a hint: nothing is eligible, and the answer is 503."""
    got = _lb_field(request, SUBSET_NAMESPACE, SUBSET)
    if got is None:
        return None
    if isinstance(got, str):
        got = [a for a in got.split(",") if a]
    assert isinstance(got, list)
    return frozenset(a.strip() for a in got)


def served(request: pb.ProcessingRequest) -> str | None:
    """The ``ip:port`` that served, where the gateway reports it (Istio's ``selected_host_key``)."""
    got = _lb_field(request, NAMESPACE, SERVED)
    return got if isinstance(got, str) and got else None


def destination_value(primary: str, fallbacks: tuple[str, ...], allow_list: bool) -> str:
    """The one value of the header and the metadata: the pick, then the fallbacks in order
    when the gateway takes a list (``override_host``); an ``ORIGINAL_DST`` pool takes one."""
    if not allow_list:
        return primary
    return ",".join((primary, *[f for f in fallbacks if f != primary]))


def lb_metadata(value: str) -> dict[str, dict[str, str]]:
    return {NAMESPACE: {DESTINATION: value}}
