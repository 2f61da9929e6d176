"""Building ext_proc ProcessingResponse messages (upb protobuf classes: the fast ones)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
PM = processing_mode_pb2.ProcessingMode

# A pass-through path needs nothing more from us after its headers.
SKIP_REST = PM(
    request_header_mode=PM.SKIP, response_header_mode=PM.SKIP,
    request_body_mode=PM.NONE, response_body_mode=PM.NONE,
    request_trailer_mode=PM.SKIP, response_trailer_mode=PM.SKIP,
)


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in headers.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def mutation(set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE)
            for k, v in (set_headers or {}).items()
        ],
        remove_headers=list(remove),
    )


def _common(set_headers: Mapping[str, str] | None, remove: Iterable[str], body: bytes | None,
            clear_route_cache: bool) -> pb.CommonResponse:
    common = pb.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(mutation(set_headers, remove))
    if body is not None:
        common.body_mutation.body = body
    if clear_route_cache:
        common.clear_route_cache = True
    return common


def headers_response(phase: str, set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = (),
                     mode_override: processing_mode_pb2.ProcessingMode | None = None,
                     timeout_s: float | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(**{phase: pb.HeadersResponse(response=_common(set_headers, remove, None, False))})
    if mode_override is not None:
        resp.mode_override.CopyFrom(mode_override)
    if timeout_s is not None:
        resp.override_message_timeout.CopyFrom(duration_from(timeout_s))
    return resp


def body_response(phase: str, body: bytes | None = None, set_headers: Mapping[str, str] | None = None,
                  remove: Iterable[str] = (), clear_route_cache: bool = False) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        **{phase: pb.BodyResponse(response=_common(set_headers, remove, body, clear_route_cache))})


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
