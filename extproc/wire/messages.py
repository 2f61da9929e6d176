"""Building ext_proc ProcessingResponse messages (upb protobuf classes: the fast ones)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Dynamic metadata namespace for response headers decided on the request side
# (the Envoy config adds them from there; see envoy_routes).
METADATA_NAMESPACE = "sluice"
RESPONSE_HEADERS_FROM_METADATA = (
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-sluice-degraded",
    # a budget's standing (extproc.openai_api.errors.BUDGET_HEADERS)
    "x-ratelimit-limit-budget-tokens", "x-ratelimit-remaining-budget-tokens", "x-ratelimit-limit-budget-cost",
    "x-ratelimit-remaining-budget-cost", "x-ratelimit-reset-budget", "x-sluice-budget-period",
)
PM = processing_mode_pb2.ProcessingMode
# An answer is a message, or one already in wire form (extproc.wire.forward_answer,
# extproc.envoy.picker_protocol.echo): the gRPC writers pass bytes through.
Answer = pb.ProcessingResponse | bytes


def serialize(answer: Answer) -> bytes:
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


def _mode(response_headers: int, response_body: int, response_trailers: int) -> PM:
    # The request side is the same in every mode: headers SEND, their answer deferred until
    # the STREAMED body is complete (extproc.envoy.extproc_filter).
    return PM(request_header_mode=PM.SEND, request_body_mode=PM.STREAMED,
              request_trailer_mode=PM.SKIP, response_header_mode=response_headers,
              response_body_mode=response_body, response_trailer_mode=response_trailers)


# The ext_proc filter's static mode: the request side only (extproc.envoy.extproc_filter).
REQUEST_ONLY = _mode(PM.SKIP, PM.NONE, PM.SKIP)

# A pass-through path needs nothing more from us after its headers.
SKIP_REST = PM(
    request_header_mode=PM.SKIP, response_header_mode=PM.SKIP,
    request_body_mode=PM.NONE, response_body_mode=PM.NONE,
    request_trailer_mode=PM.SKIP, response_trailer_mode=PM.SKIP,
)

# The whole processing mode of a request Sluice reads, per response_processing: the mode of
# the routes it matches first (extproc.envoy.routes, ExtProcPerRoute) and the mode_override
# of Sluice's answer to its headers (which Envoy 1.40 takes only from a filter without the
# one-round-trip request side). access_log: nothing of the response; usage_trailers:
# response headers (status, first byte) and the trailers Envoy's usage filter synthesizes
# with the usage, never a body chunk; streamed: every response body chunk, no headers (the
# status is an attribute).
RESPONSE_MODES = {
    "access_log": REQUEST_ONLY,
    "usage_trailers": _mode(PM.SEND, PM.NONE, PM.SEND),
    "streamed": _mode(PM.SKIP, PM.STREAMED, PM.SKIP),
}

# A response whose usage Envoy's usage filter cannot read (the Responses API: its usage
# rides in a response.completed event; an embeddings body) is read here, chunk by chunk,
# under any response_processing; the response headers bring the status and the first byte.
# The usage filter still adds trailers when it finds a `usage` object, and then the last
# body chunk is not end-of-stream: the trailers are what ends the body here.
READS_BODY = ("responses", "embeddings")
READ_RESPONSE_BODY = _mode(PM.SEND, PM.STREAMED, PM.SEND)


def response_mode(kind: str, response_processing: str) -> PM:
    """The processing mode of a request of endpoint ``kind`` (``extproc.openai_api.body``)."""
    if kind in READS_BODY and response_processing != "streamed":
        return READ_RESPONSE_BODY
    return RESPONSE_MODES[response_processing]


def header_map(headers: pb.HttpHeaders, wanted: frozenset[str] | None = None) -> dict[str, str]:
    """Header values by lower-case name; only the ``wanted`` ones are decoded. A repeated
    header's values are joined with commas, as HTTP reads them (and as Envoy already joins
    some): never one of them silently picked."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        key = h.key
        if wanted is None or key in wanted:
            raw = h.raw_value
            value = raw.decode("utf-8", "replace") if raw else h.value
            out[key] = f"{out[key]},{value}" if key in out else value
    return out


_OPTIONS: dict[tuple[str, str], base_pb2.HeaderValueOption] = {}


def _option(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Tenant, tier and backend headers repeat on every request: build each pair once.
    opt = _OPTIONS.get((key, value))
    if opt is None:
        opt = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                         append_action=OVERWRITE)
        if len(_OPTIONS) < 4096:
            _OPTIONS[(key, value)] = opt
    return opt


def mutation(set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[_option(k, v) for k, v in (set_headers or {}).items()],
        remove_headers=list(remove),
    )


def _common(set_headers: Mapping[str, str] | None, remove: Iterable[str], body: bytes | None,
            clear_route_cache: bool) -> pb.CommonResponse:
    common = pb.CommonResponse()
    if set_headers or remove:
        # Filled in place: a HeaderMutation built apart and copied in costs a second copy.
        hm = common.header_mutation
        if set_headers:
            hm.set_headers.extend([_option(k, v) for k, v in set_headers.items()])
        if remove:
            hm.remove_headers.extend(remove)
    if body is not None:
        common.body_mutation.body = body
    if clear_route_cache:
        common.clear_route_cache = True
    return common


def headers_response(phase: str, set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = (),
                     mode_override: processing_mode_pb2.ProcessingMode | None = None, clear_route_cache: bool = False,
                     metadata: Mapping[str, Mapping[str, str]] | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(
        **{phase: pb.HeadersResponse(response=_common(set_headers, remove, None, clear_route_cache))})
    if mode_override is not None:
        resp.mode_override.CopyFrom(mode_override)
    if metadata:
        _set_metadata(resp, metadata)
    return resp


def body_response(phase: str, body: bytes | None = None, set_headers: Mapping[str, str] | None = None,
                  remove: Iterable[str] = (), clear_route_cache: bool = False,
                  metadata: Mapping[str, Mapping[str, str]] | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(
        **{phase: pb.BodyResponse(response=_common(set_headers, remove, body, clear_route_cache))})
    if metadata:
        _set_metadata(resp, metadata)
    return resp


def _set_metadata(resp: pb.ProcessingResponse, metadata: Mapping[str, Mapping[str, str]]) -> None:
    # Top-level keys are namespaces; Envoy accepts those listed in metadata_options.
    # Field by field: Struct.update() walks values generically and costs ~17 us.
    fields = resp.dynamic_metadata.fields
    for ns, values in metadata.items():
        inner = fields[ns].struct_value.fields
        for k, v in values.items():
            inner[k].string_value = v


_EMPTY_BODY_RESPONSE = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CLEAR_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse(
    response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True))))


def continue_response_body() -> pb.ProcessingResponse:
    """The answer to most streamed chunks: forward unchanged (one shared message)."""
    return _EMPTY_BODY_RESPONSE


def continue_request_body() -> pb.ProcessingResponse:
    """A STREAMED request chunk forwarded unchanged (one shared message)."""
    return _CONTINUE_REQUEST_BODY


def request_chunk_answers(chunks: int, new_body: bytes | None) -> list[pb.ProcessingResponse]:
    """The answers to a STREAMED request body's ``chunks`` messages, after its headers'.

    Envoy applies each answer to the chunk it sent in that place: unchanged, every chunk
    goes on as it came; rewritten, the first carries the whole new body and the others
    are emptied."""
    if new_body is None:
        return [_CONTINUE_REQUEST_BODY] * chunks
    return [body_response("request_body", new_body), *[_CLEAR_REQUEST_BODY] * (chunks - 1)]


def attribute(request: pb.ProcessingRequest, name: str) -> object:
    """An attribute Envoy sent with this message (e.g. ``response.code``), or None."""
    for struct in request.attributes.values():
        value = struct.fields.get(name)
        if value is not None:
            kind = value.WhichOneof("kind")
            return getattr(value, kind) if kind else None
    return None


def immediate(status: int, body: bytes, headers: Mapping[str, str], details: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=mutation({"content-type": "application/json", **headers}),
        body=body,
        details=details,
    ))


def duration_from(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d
