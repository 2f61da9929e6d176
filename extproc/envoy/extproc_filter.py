"""The ext_proc HTTP filter of Sluice's listener: which phases of a request and response
Envoy sends to the server (the processing modes of each ``response_processing``), the
attributes that come with them, what the server may mutate (header mutation rules), its
timeouts and fail-closed answer, and the metadata namespaces it reads and writes.
"""

from __future__ import annotations

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ExternalProcessorRouteCacheAction,
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

from extproc.envoy import usage_record
from extproc.envoy.headers import ENVOY_MUTABLE, UPSTREAM_ATTRIBUTE
from extproc.envoy.options import EnvoyOptions, ms
from extproc.wire.messages import METADATA_NAMESPACE

__all__ = [
    "EXTPROC_CLUSTER",
    "EXTPROC_FILTER",
    "POOL_RESPONSE_ATTRIBUTES",
    "RESPONSE_ATTRIBUTES",
    "RESPONSE_PROCESSING",
    "ext_proc_filter",
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
RESPONSE_PROCESSING = ("usage_trailers", "streamed")


def _processing_mode() -> ProcessingMode:
    """The request side only. Sluice turns the response side on, request by request, in its
    answer to the request headers (``mode_override``: ``extproc.wire.messages.response_mode``
    for each ``response_processing``). Envoy runs every encoder filter on a reply it makes
    itself, ext_proc included, even for a request ext_proc never saw (observed, 1.40: an
    edge rate limit's 429 opened an ext_proc stream of its own, one round trip to Python per
    refusal); with the response side off unless Sluice asked for it, such a reply costs none."""
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    return ProcessingMode(
        request_header_mode=send,
        response_header_mode=skip,
        request_body_mode=ProcessingModeBodySendMode.BUFFERED,
        response_body_mode=ProcessingModeBodySendMode.NONE,
        request_trailer_mode=skip,
        response_trailer_mode=skip,
    )


def ext_proc_filter(opts: EnvoyOptions, pools: bool = False) -> HttpFilter:
    """The filter that calls cluster EXTPROC_CLUSTER; ``pools``: some backend is a pool."""
    streamed = opts.response_processing == "streamed"
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
            forwarding_namespaces=None if streamed else MetadataOptionsMetadataNamespaces(
                typed=[usage_record.USAGE_NAMESPACE])),
    )
    return HttpFilter(name=EXTPROC_FILTER, typed_config=Any.pack(config))
