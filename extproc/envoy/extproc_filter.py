"""The ext_proc HTTP filter of Sluice's listener: which phases of a request and response
Envoy sends to the server (statically one request side for every ``response_processing``;
the response side each of them needs on the routes Sluice reads, ``ExtProcPerRoute``),
the attributes that come with the messages, what the server may mutate (header mutation
rules), its timeouts and fail-closed answer, and the metadata namespaces it reads and writes.

The request side is one blocking round trip (observed on 1.40): request headers SEND and
the body STREAMED with ``send_body_without_waiting_for_header_response``, so Envoy sends
the headers and every body chunk back to back; the server answers the headers once the
body is complete, with every mutation (routing, ``clear_route_cache``, key stripping,
content-length, dynamic metadata), then each chunk (the rewritten body replacing them).
``allow_content_length_header`` keeps content-length, which STREAMED would drop. Envoy then
ignores ``mode_override`` (``ext_proc.cc``, ``onReceiveMessage``: only without
``send_body_without_waiting_for_header_response``), so the paths that need another mode
take it from their route (``ExtProcPerRoute``, merged once from the first route matched).
"""

from __future__ import annotations

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ExternalProcessorRouteCacheAction,
    ExtProcOverrides,
    ExtProcPerRoute,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Any
from google.protobuf import json_format

from extproc.envoy import usage_record
from extproc.envoy.headers import ENVOY_MUTABLE, UPSTREAM_ATTRIBUTE
from extproc.envoy.options import EnvoyOptions, ms
from extproc.wire import messages as msg
from extproc.wire.messages import METADATA_NAMESPACE

__all__ = [
    "EXTPROC_CLUSTER",
    "EXTPROC_FILTER",
    "POOL_RESPONSE_ATTRIBUTES",
    "RESPONSE_ATTRIBUTES",
    "RESPONSE_PROCESSING",
    "ext_proc_filter",
    "headers_only",
    "reads_response_body",
    "response_mode",
]

EXTPROC_CLUSTER = "sluice_extproc"
EXTPROC_FILTER = "envoy.filters.http.ext_proc"

# Response headers the ext_proc server decides on the request side. They travel as
# dynamic metadata in its answer to the request body and are added by the route, so
# Envoy need not stop for a response-headers round trip (one of four blocking
# messages per request: ~0.2 ms and a handler call saved on every request).
# With response headers skipped, the status arrives as an attribute of the first
# response-body message.
RESPONSE_ATTRIBUTES = ("response.code",)
# With a pool, the address that served (extproc.request.repick): on the response-headers message
# under usage_trailers, on the first response-body message when streamed (observed, 1.40).
POOL_RESPONSE_ATTRIBUTES = (UPSTREAM_ATTRIBUTE,)
# access_log: no response message; Envoy's gRPC access log brings what settle needs
# (extproc.envoy.access_log). usage_trailers: response headers and the usage trailers.
# streamed: every response chunk.
RESPONSE_PROCESSING = ("access_log", "usage_trailers", "streamed")
_SEND, _SKIP = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
_NONE = ProcessingModeBodySendMode.NONE


def _from_wire(mode: msg.PM) -> ProcessingMode:
    """One of ``extproc.wire.messages``' modes as the config's message: one definition for
    the routes' modes and the mode_override Sluice answers with."""
    return ProcessingMode.from_dict(json_format.MessageToDict(mode, preserving_proto_field_name=True))


def _processing_mode() -> ProcessingMode:
    """The filter's static mode: the request side only. Envoy runs every encoder filter on a
    reply it makes itself, ext_proc included, even for a request ext_proc never saw
    (observed, 1.40: an edge rate limit's 429 opened an ext_proc stream of its own, one
    round trip to Python per refusal). The routes Sluice reads turn the response side on
    (``response_mode``): Envoy merges a route's mode in ext_proc's ``decodeHeaders``
    (``Filter::mergePerRouteConfig``), which a reply made by a filter before it never
    reaches, so such a reply costs none."""
    return _from_wire(msg.REQUEST_ONLY)


def _per_route(mode: ProcessingMode) -> ExtProcPerRoute:
    return ExtProcPerRoute(overrides=ExtProcOverrides(processing_mode=mode))


def response_mode(response_processing: str) -> ExtProcPerRoute | None:
    """The route mode of the endpoints Sluice reads, per ``response_processing``; None for
    ``access_log``, whose response side is the static one (off)."""
    if response_processing == "access_log":
        return None
    return _per_route(_from_wire(msg.RESPONSE_MODES[response_processing]))


def reads_response_body(response_processing: str) -> ExtProcPerRoute | None:
    """The route mode of a response Sluice reads itself (``extproc.wire.messages.READS_BODY``:
    the Responses API's usage rides in a ``response.completed`` event Envoy's usage filter
    cannot read, and it reads no embeddings usage)."""
    return _per_route(_from_wire(msg.response_mode(msg.READS_BODY[0], response_processing)))


def headers_only() -> ExtProcPerRoute:
    """The route mode of the paths Sluice does not read (``/v1/models``, which it answers, and
    the pass-through paths, which it only authenticates and routes): the request headers
    alone, so a pass-through upload streams past Sluice and nothing of the response comes."""
    return _per_route(ProcessingMode(request_header_mode=_SEND, request_body_mode=_NONE,
                                     request_trailer_mode=_SKIP, response_header_mode=_SKIP,
                                     response_body_mode=_NONE, response_trailer_mode=_SKIP))


def ext_proc_filter(opts: EnvoyOptions, pools: bool = False) -> HttpFilter:
    """The filter that calls cluster EXTPROC_CLUSTER; ``pools``: some backend is a pool."""
    streamed = opts.response_processing == "streamed"
    # Response attributes ride on the first response message, so they cost nothing on a
    # route without one (access_log: the served address comes with the log entry).
    attributes = [*(RESPONSE_ATTRIBUTES if streamed else ()), *(POOL_RESPONSE_ATTRIBUTES if pools else ())]
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            # Observed in 1.40: not applied to the ext_proc stream (no grpc-timeout is sent,
            # and streams outlive it); message_timeout below bounds each wait instead.
            timeout=ms(opts.message_timeout_ms),
        ),
        processing_mode=_processing_mode(),
        message_timeout=ms(opts.message_timeout_ms),
        max_message_timeout=ms(opts.max_message_timeout_ms),
        failure_mode_allow=opts.failure_mode_allow,
        status_on_error=HttpStatus(code=StatusCode(opts.status_on_error)),
        # One blocking round trip on the request side (the module docstring). Envoy 1.40
        # ignores mode_override with it: the routes carry the modes, and the override Sluice
        # answers with (the same modes) matters only to a filter configured without it.
        send_body_without_waiting_for_header_response=True,
        allow_content_length_header=True,
        allow_mode_override=True,
        # Envoy's defaults, spelled out: the server may set/remove any header
        # (authorization, x-api-key, content-length, x-sluice-*) except host,
        # :authority, :scheme, :method and x-envoy-*; a disallowed mutation is
        # ignored and counted in ext_proc's rejected_header_mutations. The router's retry
        # and timeout headers are the exception (extproc.envoy.headers.ENVOY_MUTABLE): Sluice sets
        # x-envoy-max-retries: 0 on a pool request without a second choice, and removes a
        # client's copies of all of them (Envoy strips them at the edge too, envoyconfig._edge_options).
        mutation_rules=HeaderMutationRules(allow_all_routing=False, allow_envoy=False,
                                           allow_expression=RegexMatcher(regex=ENVOY_MUTABLE)),
        # DEFAULT: re-match routes when a response carries clear_route_cache together
        # with a header mutation (how x-sluice-backend takes effect).
        route_cache_action=ExternalProcessorRouteCacheAction.DEFAULT,
        stat_prefix="sluice",
        response_attributes=attributes,
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[METADATA_NAMESPACE]),
            forwarding_namespaces=None if opts.response_processing != "usage_trailers" else
            MetadataOptionsMetadataNamespaces(typed=[usage_record.USAGE_NAMESPACE])),
    )
    return HttpFilter(name=EXTPROC_FILTER, typed_config=Any.pack(config))
