"""Render the Envoy bootstrap that puts Sluice's ext_proc in front of the backends.

The config is built from envoy-data-plane's typed classes (so a misspelt field fails here,
not in Envoy) and turned into a plain dict with ``to_dict()``; ``render_yaml`` dumps it.
``Any.pack`` looks the message type up in a registry that is filled when a message's
module is imported, so every packed type is imported at module level below (and in the
modules that build the parts).

This module assembles the bootstrap (listener, HTTP connection manager, access log,
overload manager) and is the public entry point; the parts are built in
``envoy_options`` (``BackendRoute``, ``EnvoyOptions``), ``envoy_extproc`` (the ext_proc
filter), ``envoy_routes`` (routes and the pool re-pick), ``envoy_clusters`` (clusters),
``envoy_replies`` (Envoy's own replies) and ``envoy_usage`` (usage extraction).

Shape of the generated config::

    overload manager: at most max_connections downstream connections
    listener listen_host:listen_port  (per-connection buffer > the policy's body cap)
      http_connection_manager  codec AUTO, edge (use_remote_address), request and
                               header timeouts, JSON access log to stdout (no query)
        envoy.filters.http.header_mutation  client-sent x-sluice-* and routing headers removed
        envoy.filters.http.local_ratelimit  per key and per client address (if the policy says)
        envoy.filters.http.ext_proc -> cluster sluice_extproc (HTTP/2)
        envoy.filters.http.router
          route  no key of the right shape -> 401 from Envoy (extproc.envoy.edge)
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

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import betterproto2
import yaml

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.bootstrap.v3 import (
    Admin,
    Bootstrap,
    BootstrapStaticResources,
    LayeredRuntime,
    RuntimeLayer,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Node,
    SubstitutionFormatString,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
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
from envoy_data_plane.google.protobuf import Any, Struct

from extproc.envoy import usage_record
from extproc.envoy.access_log import access_log_clusters, access_loggers
from extproc.envoy.clusters import (
    DRAIN_CLUSTER,
    backend_cluster,
    extproc_cluster,
    pool_cluster,
    socket_address,
)
from extproc.envoy.edge import ratelimit_filters, strip_filter
from extproc.envoy.extproc_filter import (
    EXTPROC_CLUSTER,
    EXTPROC_FILTER,
    RESPONSE_PROCESSING,
    ext_proc_filter,
)
from extproc.envoy.options import (
    BackendRoute,
    EnvoyOptions,
    buffer_limit_bytes,
    gateway_options,
    ms,
    policy_options,
    seconds,
)
from extproc.envoy.replies import local_reply_config
from extproc.envoy.routes import BACKEND_HEADER, LONG_IDLE, route_config

__all__ = [
    "BACKEND_HEADER",
    "DRAIN_CLUSTER",
    "EXTPROC_CLUSTER",
    "EXTPROC_FILTER",
    "HEADER",
    "BackendRoute",
    "EnvoyOptions",
    "buffer_limit_bytes",
    "extproc_endpoints",
    "gateway_options",
    "policy_options",
    "render_bootstrap",
    "render_yaml",
    "write_config",
]

HEADER = "# generated by python -m extproc envoy-config; do not edit\n"
GRACEFUL_CLOSE_FLAG = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
ROUTER_FILTER = "envoy.filters.http.router"

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
        "request_headers_timeout": seconds(opts.request_headers_timeout_s),
        "request_timeout": seconds(opts.request_timeout_s),
    }


def extproc_endpoints(opts: EnvoyOptions) -> list[tuple[str, int]]:
    """Every ext_proc endpoint (replica or worker), in the cluster's order."""
    return [(opts.extproc_host, opts.extproc_port), *opts.extproc_more]


def _access_logs(opts: EnvoyOptions) -> list[AccessLog]:
    logs = [_access_log()] if opts.access_log else []
    if opts.response_processing == "access_log":
        logs += access_loggers(extproc_endpoints(opts), opts.access_log_flush_ms, opts.access_log_buffer_bytes)
    return logs


def _listener(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> Listener:
    http_filters = [
        # first: no filter, and no route, sees a client's x-sluice-* (extproc.envoy.edge)
        strip_filter(),
        *ratelimit_filters(opts.edge),
        ext_proc_filter(opts, any(b.pool for b in backends)),
        HttpFilter(name=ROUTER_FILTER, typed_config=Any.pack(Router())),
    ]
    hcm = HttpConnectionManager(
        stat_prefix="sluice",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        # usage_record.install adds its Lua filter to this chain after rendering: off on the drain too
        route_config=route_config(backends, opts, [EXTPROC_FILTER]
                                  + ([] if opts.response_processing == "streamed" else [usage_record.LUA_FILTER])),
        http_filters=http_filters,
        stream_idle_timeout=LONG_IDLE,
        access_log=_access_logs(opts),
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
                *(pool_cluster(b.name, ms(opts.backend_connect_timeout_ms), opts.eds_dir or ".") if b.pool else
                  backend_cluster(b.name, b.host, b.port, ms(opts.backend_connect_timeout_ms))
                  for b in backends),
                backend_cluster(DRAIN_CLUSTER, opts.drain_host, opts.drain_port, ms(250)),
                *(access_log_clusters(extproc_endpoints(opts), opts.extproc_max_requests)
                  if opts.response_processing == "access_log" else ()),
            ],
        ),
        layered_runtime=LayeredRuntime(layers=[RuntimeLayer(
            name="sluice", static_layer=Struct.from_dict({GRACEFUL_CLOSE_FLAG: opts.ext_proc_graceful_close}))]),
    )
    cfg = bootstrap.to_dict(casing=betterproto2.Casing.SNAKE)
    if opts.response_processing == "streamed":
        return cfg
    # usage_trailers and access_log: Envoy reads the usage (and hides the chunk Sluice asked for)
    return usage_record.install(cfg, {b.name for b in backends}, EXTPROC_FILTER,
                               trailers=opts.response_processing == "usage_trailers")


def render_yaml(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> str:
    models = [f"#   {b.name}: {', '.join(b.models)}\n" for b in backends if b.models]
    body = yaml.safe_dump(render_bootstrap(backends, opts), sort_keys=False)
    return HEADER + ("# models served:\n" + "".join(models) if models else "") + body


def write_config(path: str | Path, backends: Sequence[BackendRoute], opts: EnvoyOptions) -> Path:
    """Write the rendered YAML to ``path`` (parent directories created) and return it.

    Pools read their endpoints from ``opts.eds_dir``, by default ``path``'s directory;
    the directory is created, the files are ``extproc.envoy.eds``'s job."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(b.pool for b in backends):
        opts = replace(opts, eds_dir=opts.eds_dir or str(path.parent))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_yaml(backends, opts))
    tmp.replace(path)
    return path
