"""Render the Envoy bootstrap that puts Sluice's ext_proc in front of the backends.

The config is built from envoy-data-plane's typed classes (so a misspelt field fails here,
not in Envoy) and turned into a plain dict with ``to_dict()``; ``render_yaml`` dumps it.
``Any.pack`` looks the message type up in a registry that is filled when a message's
module is imported, so every packed type is imported at module level below (and in
``envoy_clusters`` and ``envoy_replies``, which build the clusters and Envoy's own
replies).

Shape of the generated config::

    overload manager: at most max_connections downstream connections
    listener listen_host:listen_port  (per-connection buffer > the policy's body cap)
      http_connection_manager  codec AUTO, edge (use_remote_address), request and
                               header timeouts, JSON access log to stdout (no query)
        envoy.filters.http.ext_proc -> cluster sluice_extproc (HTTP/2)
        envoy.filters.http.router
          route  OpenAI endpoint, content-length > cap -> sluice_drain, filters off
          route  x-sluice-backend == <name>  -> cluster <name>   (one per backend)
          route  catch-all                   -> first backend
    clusters: sluice_extproc, one HTTP/1.1 cluster per backend, sluice_drain
              (extproc's admin port, /drain)

What the ext_proc server can rely on (each observed with Envoy 1.40):
- Routing: set ``x-sluice-backend`` in the header mutation of the request-body response
  with ``clear_route_cache: true`` (route_cache_action DEFAULT re-matches; without the
  flag the catch-all route stays cached). A client-sent ``x-sluice-backend`` is stripped
  on arrival (``internal_only_headers``) and the header never goes upstream.
- Body rewrite (request body BUFFERED, headers SEND): content-length is kept; set it to
  the new length in the same body response, or Envoy answers status_on_error.
- Header values must go in ``raw_value``; a mutation with only ``value`` sets "".
- status_on_error covers an unreachable or failing server; a message_timeout expiry
  answers 504, which the local-reply mapper turns into the same 503. Envoy's own
  replies (413 over the buffer, ext_proc failures, 408 timeouts) get Sluice's error
  JSON and ``x-sluice-reason`` there, and still pass through the response phases of
  ext_proc.
- The server may rewrite ``:path`` in its request-headers answer (the mutation rules
  allow it; Sluice drops credential query parameters that way). The response body is STREAMED, so clients get chunked
  responses (Envoy drops the upstream content-length).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import betterproto2
import yaml

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import (
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    Node,
    SubstitutionFormatString,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.config.route.v3 import (
    FilterConfig,
    HeaderMatcher,
    RetryPolicy,
    RetryPolicyRetryBackOff,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ExternalProcessorRouteCacheAction,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.formatter.req_without_query.v3 import ReqWithoutQuery
from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import (
    DownstreamConnectionsConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import (
    RegexMatchAndSubstitute,
    RegexMatcher,
    StringMatcher,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, Int64Range, StatusCode
from envoy_data_plane.google.protobuf import Any, Struct

from extproc import envoy_usage
from extproc.drain import DRAIN_PATH, LIMIT_HEADER
from extproc.envoy_clusters import (
    DRAIN_CLUSTER,
    backend_cluster,
    extproc_cluster,
    pool_cluster,
    socket_address,
)
from extproc.envoy_replies import local_reply_config
from extproc.messages import METADATA_NAMESPACE, RESPONSE_HEADERS_FROM_METADATA
from extproc.openai_body import ENDPOINTS
from extproc.policy.model import Gateway
from extproc.repick import ENVOY_MUTABLE

__all__ = [
    "BACKEND_HEADER",
    "DRAIN_CLUSTER",
    "EXTPROC_CLUSTER",
    "EXTPROC_FILTER",
    "HEADER",
    "BackendRoute",
    "EnvoyOptions",
    "buffer_limit_bytes",
    "gateway_options",
    "render_bootstrap",
    "render_yaml",
    "write_config",
]

HEADER = "# generated by python -m extproc envoy-config; do not edit\n"
BACKEND_HEADER = "x-sluice-backend"
EXTPROC_CLUSTER = "sluice_extproc"
ROUTER_FILTER = "envoy.filters.http.router"
EXTPROC_FILTER = "envoy.filters.http.ext_proc"
_MIB = 1024 * 1024
_LONG_IDLE = datetime.timedelta(seconds=300)  # SSE streams may pause between tokens

# One JSON line per request on stdout. Everything Sluice decides is in x-sluice-reason;
# the ext_proc filter state carries per-phase gRPC latencies and call counts.
ACCESS_LOG_FORMAT: dict[str, str] = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    # Without the query string: clients put API keys there (?api_key=...), and the log
    # must not keep them. A client-sent x-envoy-original-path is stripped on arrival.
    "path": "%REQ_WITHOUT_QUERY(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "upstream_ms": "%RESPONSE_DURATION%",
    "bytes_in": "%BYTES_RECEIVED%",
    "bytes_out": "%BYTES_SENT%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "sluice_reason": "%RESP(X-SLUICE-REASON)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "ext_proc": f"%FILTER_STATE({EXTPROC_FILTER}:TYPED)%",
}


@dataclass(frozen=True)
class BackendRoute:
    name: str  # cluster name, e.g. "sim"
    host: str  # e.g. "127.0.0.1"
    port: int
    models: tuple[str, ...] = ()  # informational
    pool: bool = False  # endpoints picked by Sluice: an EDS cluster (envoy_clusters.pool_cluster)


@dataclass(frozen=True)
class EnvoyOptions:
    listen_host: str = "127.0.0.1"
    listen_port: int = 10000
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"
    extproc_port: int = 50051
    extproc_more: tuple[tuple[str, int], ...] = ()  # further extproc replicas: more endpoints of its cluster
    message_timeout_ms: int = 2000  # per ext_proc message
    # upper bound a server may ask for with override_message_timeout (queued requests)
    max_message_timeout_ms: int = 120000
    failure_mode_allow: bool = False
    status_on_error: int = 503  # what clients get when ext_proc is down/fails (fail closed)
    # the policy's body cap; per_connection_buffer_limit_bytes must exceed it
    max_body_bytes: int = 1048576
    # circuit breaker thresholds on the ext_proc cluster, far above Envoy's default 1024
    extproc_max_requests: int = 100000
    access_log: bool = True
    backend_connect_timeout_ms: int = 2000
    # Where oversized uploads are drained: extproc's admin port (extproc/drain.py).
    drain_host: str = "127.0.0.1"
    drain_port: int = 9100
    drain_timeout_s: float = 30.0
    # Edge hygiene (gateway policy settings of the same names).
    request_headers_timeout_s: float = 10.0
    request_timeout_s: float = 120.0
    max_connections: int = 1024
    trusted_proxy_hops: int = 0
    # Envoy's health checks / outlier detection of the extproc replicas (envoy_clusters.extproc_health)
    extproc_health_interval_s: float = 1.0
    extproc_unhealthy_threshold: int = 2
    # the policy's gateway.response_processing: "usage_trailers" (Envoy reads the usage,
    # extproc gets one message per response) or "streamed" (every body chunk to extproc)
    response_processing: str = "usage_trailers"
    # Where the pools' endpoint files are (<eds_dir>/<pool>.eds.yaml, extproc.envoy_eds);
    # "" in write_config: the rendered config's directory.
    eds_dir: str = ""
    # A pool route's wait before it re-picks after a refused connection (Envoy's back-off
    # is random up to this; the retry goes to another endpoint, so there is nothing to wait for).
    repick_backoff_ms: int = 1


def gateway_options(gw: Gateway) -> dict[str, object]:
    """The EnvoyOptions that come from the policy's gateway section, as keyword arguments."""
    return {
        "failure_mode_allow": gw.failure_mode_allow,
        "message_timeout_ms": gw.message_timeout_ms,
        "max_body_bytes": gw.max_body_bytes,
        "drain_timeout_s": gw.drain_timeout_s,
        "request_headers_timeout_s": gw.request_headers_timeout_s,
        "request_timeout_s": gw.request_timeout_s,
        "max_connections": gw.max_connections,
        "trusted_proxy_hops": gw.trusted_proxy_hops,
        "extproc_health_interval_s": gw.extproc_health_interval_s,
        "extproc_unhealthy_threshold": gw.extproc_unhealthy_threshold,
        "response_processing": gw.response_processing,
    }


def buffer_limit_bytes(max_body_bytes: int) -> int:
    """Per-connection buffer: large enough that Sluice, not Envoy, answers oversized bodies."""
    return max(2 * max_body_bytes, max_body_bytes + _MIB)


def _ms(value: int) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=value)


def _s(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


# Response headers the ext_proc server decides on the request side. They travel as
# dynamic metadata in its answer to the request body and are added by the route, so
# Envoy need not stop for a response-headers round trip (one of four blocking
# messages per request: ~0.2 ms and a handler call saved on every request).
# With response headers skipped, the status arrives as an attribute of the first
# response-body message.
RESPONSE_ATTRIBUTES = ("response.code",)
# With a pool, the address that served (extproc.repick): on the response-headers message
# under usage_trailers, on the first response-body message when streamed (observed, 1.40).
POOL_RESPONSE_ATTRIBUTES = ("upstream.address",)
RESPONSE_PROCESSING = ("usage_trailers", "streamed")


def _processing_mode(response_processing: str) -> ProcessingMode:
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    if response_processing == "streamed":
        return ProcessingMode(
            request_header_mode=send,
            response_header_mode=skip,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            response_body_mode=ProcessingModeBodySendMode.STREAMED,
            request_trailer_mode=skip,
            response_trailer_mode=skip,
        )
    # usage_trailers: response headers (status, first byte) and the trailers that
    # envoy_usage's filter synthesizes with the usage; never a body chunk.
    return ProcessingMode(
        request_header_mode=send,
        response_header_mode=send,
        request_body_mode=ProcessingModeBodySendMode.BUFFERED,
        response_body_mode=ProcessingModeBodySendMode.NONE,
        request_trailer_mode=skip,
        response_trailer_mode=send,
    )


def _ext_proc_filter(opts: EnvoyOptions, pools: bool = False) -> HttpFilter:
    streamed = opts.response_processing == "streamed"
    attributes = [*(RESPONSE_ATTRIBUTES if streamed else ()), *(POOL_RESPONSE_ATTRIBUTES if pools else ())]
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            # Observed in 1.40: not applied to the ext_proc stream (no grpc-timeout is sent,
            # and streams outlive it); message_timeout below bounds each wait instead.
            timeout=_ms(opts.message_timeout_ms),
        ),
        processing_mode=_processing_mode(opts.response_processing),
        message_timeout=_ms(opts.message_timeout_ms),
        max_message_timeout=_ms(opts.max_message_timeout_ms),
        failure_mode_allow=opts.failure_mode_allow,
        status_on_error=HttpStatus(code=StatusCode(opts.status_on_error)),
        allow_mode_override=True,
        # Envoy's defaults, spelled out: the server may set/remove any header
        # (authorization, x-api-key, content-length, x-sluice-*) except host,
        # :authority, :scheme, :method and x-envoy-*; a disallowed mutation is
        # ignored and counted in ext_proc's rejected_header_mutations. The router's retry
        # and timeout headers are the exception (extproc.repick.ENVOY_MUTABLE): Sluice sets
        # x-envoy-max-retries: 0 on a pool request without a second choice, and removes a
        # client's copies of all of them (Envoy strips them at the edge too, _edge_options).
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
                typed=[envoy_usage.USAGE_NAMESPACE])),
    )
    return HttpFilter(name=EXTPROC_FILTER, typed_config=Any.pack(config))


def _headers_from_metadata() -> list[HeaderValueOption]:
    return [
        HeaderValueOption(
            header=HeaderValue(key=name, value=f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{name})%"),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
            keep_empty_value=False,  # absent for passthrough paths and Envoy's own replies
        )
        for name in RESPONSE_HEADERS_FROM_METADATA
    ]


# The only retry: a pool request whose connection was refused (or timed out connecting)
# goes once to Sluice's second choice (x-sluice-endpoint's next host). Never on a reset
# or a 5xx: a request that reached an engine may be generating already, and a replay
# would generate twice for one bill.
REPICK_ON = "connect-failure"


def _repick(opts: EnvoyOptions) -> RetryPolicy:
    backoff = _ms(opts.repick_backoff_ms)
    return RetryPolicy(retry_on=REPICK_ON, num_retries=1,
                       retry_back_off=RetryPolicyRetryBackOff(base_interval=backoff, max_interval=backoff))


def _route(b: BackendRoute, headers: list[HeaderMatcher], opts: EnvoyOptions) -> Route:
    """A backend's route; a pool's re-picks once on a refused connection (who served comes to
    extproc as the ``upstream.address`` attribute, extproc.repick)."""
    return Route(
        match=RouteMatch(prefix="/", headers=headers),
        route=RouteAction(
            cluster=b.name,
            timeout=datetime.timedelta(0),  # no overall limit: generations stream for minutes
            idle_timeout=_LONG_IDLE,
            retry_policy=_repick(opts) if b.pool else None,
        ),
    )


def _drain_route(opts: EnvoyOptions, filters: Sequence[str]) -> Route:
    """Uploads declaring a body over the cap go to the drain, past every filter but the router.

    Envoy answering them itself (or ext_proc answering at request headers) closes the
    connection with the body unread, and the RST destroys the 413 (see extproc/drain.py).
    Here Envoy streams the body to the drain, which discards it and answers 413 once the
    request is complete. A request ext_proc has rerouted (x-sluice-backend set, route
    re-matched after a body rewrite) never lands here. Only the endpoints Sluice reads
    are capped: pass-through paths (``unknown_paths: passthrough``) stream as before.
    """
    endpoints = "|".join(re.escape(p) for p in ENDPOINTS)
    over_cap = HeaderMatcher(name="content-length",
                             range_match=Int64Range(start=opts.max_body_bytes + 1, end=1 << 62))
    not_rerouted = HeaderMatcher(name=BACKEND_HEADER, present_match=True, invert_match=True)
    return Route(
        name="drain_oversized_upload",
        match=RouteMatch(safe_regex=RegexMatcher(regex=f"^({endpoints})$"), headers=[over_cap, not_rerouted]),
        route=RouteAction(
            cluster=DRAIN_CLUSTER,
            regex_rewrite=RegexMatchAndSubstitute(pattern=RegexMatcher(regex="^/.*"), substitution=DRAIN_PATH),
            # counted from the end of the upload, which the drain itself bounds
            timeout=_s(10),
        ),
        request_headers_to_add=[HeaderValueOption(
            header=HeaderValue(key=LIMIT_HEADER, value=str(opts.max_body_bytes)),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )],
        typed_per_filter_config={name: Any.pack(FilterConfig(disabled=True)) for name in filters},
    )


def _route_config(backends: Sequence[BackendRoute], opts: EnvoyOptions,
                  filters: Sequence[str]) -> RouteConfiguration:
    routes = [_drain_route(opts, filters)]
    routes.extend(
        _route(
            b,
            [HeaderMatcher(name=BACKEND_HEADER, string_match=StringMatcher(exact=b.name))],
            opts,
        )
        for b in backends
    )
    routes.append(_route(backends[0], [], opts))
    return RouteConfiguration(
        name="sluice_routes",
        virtual_hosts=[VirtualHost(name="sluice", domains=["*"], routes=routes)],
        # Clients cannot pick a backend or claim a body limit: Envoy strips client-sent
        # copies before any filter runs (every request is external, see _edge_options),
        # and the one ext_proc sets never goes upstream.
        internal_only_headers=[BACKEND_HEADER, LIMIT_HEADER],
        request_headers_to_remove=[BACKEND_HEADER],
        response_headers_to_add=_headers_from_metadata(),
    )


def _access_log() -> AccessLog:
    fmt = SubstitutionFormatString(
        json_format=Struct.from_dict(ACCESS_LOG_FORMAT),
        # %REQ_WITHOUT_QUERY(...)% is an extension that must be named here
        formatters=[TypedExtensionConfig(name="envoy.formatter.req_without_query",
                                         typed_config=Any.pack(ReqWithoutQuery()))],
    )
    return AccessLog(
        name="envoy.access_loggers.stdout",
        typed_config=Any.pack(StdoutAccessLog(log_format=fmt)),
    )


def _edge_options(opts: EnvoyOptions) -> dict[str, object]:
    """HCM settings for a proxy at the edge, which trusts nothing a client sends about itself.

    use_remote_address: the client is the peer address (or, with trusted_proxy_hops, the
    address that many proxies back in X-Forwarded-For), and no address counts as
    internal, so Envoy strips client-sent x-envoy-* headers (x-envoy-original-path,
    which the access log reads, among them) and the internal_only_headers, and replaces
    a client's x-request-id with a fresh one (preserve_external_request_id off).
    """
    return {
        "use_remote_address": True,
        "xff_num_trusted_hops": opts.trusted_proxy_hops,
        "preserve_external_request_id": False,
        "generate_request_id": True,
        # time to receive the headers, and the whole request (until it goes upstream, so a
        # queued request's wait counts; streaming responses are not limited by it)
        "request_headers_timeout": _s(opts.request_headers_timeout_s),
        "request_timeout": _s(opts.request_timeout_s),
    }


def _listener(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> Listener:
    http_filters = [
        _ext_proc_filter(opts, any(b.pool for b in backends)),
        HttpFilter(name=ROUTER_FILTER, typed_config=Any.pack(Router())),
    ]
    hcm = HttpConnectionManager(
        stat_prefix="sluice",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        # envoy_usage.install adds its Lua filter to this chain after rendering: off on the drain too
        route_config=_route_config(backends, opts, [f.name for f in http_filters if f.name != ROUTER_FILTER]
                                   + ([] if opts.response_processing == "streamed" else [envoy_usage.LUA_FILTER])),
        http_filters=http_filters,
        stream_idle_timeout=_LONG_IDLE,
        access_log=[_access_log()] if opts.access_log else [],
        local_reply_config=local_reply_config(),
        **_edge_options(opts),  # type: ignore[arg-type]
    )
    return Listener(
        name="sluice_listener",
        address=socket_address(opts.listen_host, opts.listen_port),
        per_connection_buffer_limit_bytes=buffer_limit_bytes(opts.max_body_bytes),
        filter_chains=[
            FilterChain(
                filters=[
                    Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=Any.pack(hcm),
                    )
                ]
            )
        ],
    )


def _check(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> None:
    if not backends:
        raise ValueError("at least one backend is needed")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate backend names: {names}")
    for reserved in (EXTPROC_CLUSTER, DRAIN_CLUSTER):
        if reserved in names:
            raise ValueError(f"backend name {reserved!r} is reserved")
    for name in names:
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"bad backend name {name!r}")
    if opts.max_message_timeout_ms < opts.message_timeout_ms:
        raise ValueError("max_message_timeout_ms must be >= message_timeout_ms")
    if opts.response_processing not in RESPONSE_PROCESSING:
        raise ValueError(f"response_processing must be one of {RESPONSE_PROCESSING}")
    if not 200 <= opts.status_on_error <= 599:
        raise ValueError(f"status_on_error {opts.status_on_error} is not an HTTP status")


def _overload_manager(opts: EnvoyOptions) -> OverloadManager:
    # Connections beyond max_connections are refused at accept: slow or idle clients cannot
    # pile up buffers (each connection may hold up to the buffer limit) without bound.
    # Envoy's own answer to its warning "no configured limit to the number of allowed
    # active downstream connections".
    monitor = DownstreamConnectionsConfig(max_active_downstream_connections=opts.max_connections)
    return OverloadManager(resource_monitors=[ResourceMonitor(
        name="envoy.resource_monitors.global_downstream_max_connections", typed_config=Any.pack(monitor))])


def render_bootstrap(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> dict:
    """The bootstrap as a plain dict (snake_case field names, durations as "1.5s")."""
    _check(backends, opts)
    bootstrap = Bootstrap(
        node=Node(id="sluice", cluster="sluice"),
        # /ready and /stats stay reachable while clients hold every allowed connection
        admin=Admin(address=socket_address("127.0.0.1", opts.admin_port), ignore_global_conn_limit=True),
        overload_manager=_overload_manager(opts),
        static_resources=BootstrapStaticResources(
            listeners=[_listener(backends, opts)],
            clusters=[
                extproc_cluster(EXTPROC_CLUSTER, opts.extproc_host, opts.extproc_port,
                                opts.extproc_max_requests, opts.extproc_more,
                                opts.extproc_health_interval_s, opts.extproc_unhealthy_threshold),
                *(pool_cluster(b.name, _ms(opts.backend_connect_timeout_ms), opts.eds_dir or ".") if b.pool else
                  backend_cluster(b.name, b.host, b.port, _ms(opts.backend_connect_timeout_ms))
                  for b in backends),
                backend_cluster(DRAIN_CLUSTER, opts.drain_host, opts.drain_port, _ms(250)),
            ],
        ),
    )
    cfg = bootstrap.to_dict(casing=betterproto2.Casing.SNAKE)
    if opts.response_processing == "streamed":
        return cfg
    return envoy_usage.install(cfg, {b.name for b in backends}, EXTPROC_FILTER)


def render_yaml(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> str:
    models = [f"#   {b.name}: {', '.join(b.models)}\n" for b in backends if b.models]
    body = yaml.safe_dump(render_bootstrap(backends, opts), sort_keys=False)
    return HEADER + ("# models served:\n" + "".join(models) if models else "") + body


def write_config(path: str | Path, backends: Sequence[BackendRoute], opts: EnvoyOptions) -> Path:
    """Write the rendered YAML to ``path`` (parent directories created) and return it.

    Pools read their endpoints from ``opts.eds_dir``, by default ``path``'s directory;
    the directory is created, the files are ``extproc.envoy_eds``'s job."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(b.pool for b in backends):
        opts = replace(opts, eds_dir=opts.eds_dir or str(path.parent))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_yaml(backends, opts))
    tmp.replace(path)
    return path
