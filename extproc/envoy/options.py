"""What Envoy's bootstrap is rendered from: the backends as routes and clusters
(``BackendRoute``) and the deployment's settings (``EnvoyOptions``, partly from the
policy's gateway section, ``gateway_options``). Public through ``extproc.envoy.bootstrap``;
here so the modules that render the parts (``envoy_extproc``, ``envoy_routes``) take the
options without importing the module that assembles them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from extproc.policy.edge import EdgeLimits, edge_limits
from extproc.policy.schema import Gateway, Policy

__all__ = ["BackendRoute", "EnvoyOptions", "buffer_limit_bytes", "gateway_options", "ms",
           "policy_options", "seconds"]
_MIB = 1024 * 1024


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
    # Where oversized uploads are drained: extproc's admin port (extproc/service/drain.py).
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
    # the policy's gateway.response_processing: "access_log" (no response message: Envoy's
    # gRPC access log brings status, first byte, served address and usage), "usage_trailers"
    # (Envoy reads the usage, extproc gets two messages per response) or "streamed" (every
    # body chunk to extproc)
    response_processing: str = "usage_trailers"
    # Where the pools' endpoint files are (<eds_dir>/<pool>.eds.yaml, extproc.envoy.eds);
    # "" in write_config: the rendered config's directory.
    eds_dir: str = ""
    # The longest a response may take once the request went upstream (0: no limit): the
    # backend routes' timeout, after which Envoy answers or ends the stream with 504.
    response_timeout_s: float = 600.0
    # response_processing access_log: how often each Envoy worker flushes its buffered
    # access-log entries to Sluice, and the most it buffers: it flushes early past that, and
    # while its stream to Sluice is congested it keeps entries up to it and drops the rest
    # (grpc_access_logger_clients.h: a flush fails above the stream's write watermark).
    # Seen with 16 KiB under 64 streaming clients on a loaded box: 26 of 1,206 entries
    # dropped; 1 MiB rides out such a stall (~1,000 entries). The flush interval is the
    # policy's (gateway.access_log_flush_ms, 10 ms): a shorter one spreads the settles, a
    # longer one sends fewer messages (docs/round-trips.md).
    access_log_flush_ms: int = 10
    access_log_buffer_bytes: int = 1 << 20
    # Envoy runtime flag: ext_proc half-closes a finished stream and waits for the
    # server's close instead of resetting it (measured in bench.overhead).
    ext_proc_graceful_close: bool = True
    # A pool route's wait before it re-picks after a refused connection (Envoy's back-off
    # is random up to this; the retry goes to another endpoint, so there is nothing to wait for).
    repick_backoff_ms: int = 1
    # What Envoy refuses before asking Sluice (extproc.envoy.edge): the key's shape, and the
    # per-key and per-address rates; extproc.policy.edge.edge_limits(policy) resolves them.
    edge: EdgeLimits = EdgeLimits()


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
        "response_timeout_s": gw.response_timeout_s,
        "access_log_flush_ms": gw.access_log_flush_ms,
    }


def policy_options(policy: Policy) -> dict[str, object]:
    """``gateway_options`` and what else the whole policy decides: the edge limits, whose
    per-key rate is the fastest any tier or tenant may go."""
    return {**gateway_options(policy.gateway), "edge": edge_limits(policy)}


def buffer_limit_bytes(max_body_bytes: int) -> int:
    """Per-connection buffer: large enough that Sluice, not Envoy, answers oversized bodies.

    Also the most request body Envoy queues for ext_proc before it stops reading from the
    client (a STREAMED body waits in that queue until its headers are answered)."""
    return max(2 * max_body_bytes, max_body_bytes + _MIB)


def ms(value: int) -> datetime.timedelta:
    """An option in milliseconds as the duration Envoy's field takes."""
    return datetime.timedelta(milliseconds=value)


def seconds(value: float) -> datetime.timedelta:
    """An option in seconds as the duration Envoy's field takes."""
    return datetime.timedelta(seconds=value)
