"""The clusters of the Envoy bootstrap: the ext_proc server (HTTP/2) and one HTTP/1.1
cluster per backend, each with one endpoint and circuit-breaker thresholds.

Takes plain values rather than ``EnvoyOptions`` so ``extproc.envoyconfig``, which
owns the options and assembles the bootstrap, can import this without a cycle.
"""

from __future__ import annotations

import datetime
import ipaddress

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    ClusterDnsLookupFamily,
    ClusterLbPolicy,
    ClusterOriginalDstLbConfig,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    Http1ProtocolOptions,
    Http2ProtocolOptions,
    SocketAddress,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.google.protobuf import Any

__all__ = ["DRAIN_CLUSTER", "ENDPOINT_HEADER", "backend_cluster", "extproc_cluster", "pool_cluster",
           "socket_address"]

DRAIN_CLUSTER = "sluice_drain"  # extproc's admin port, where oversized uploads are drained
ENDPOINT_HEADER = "x-sluice-endpoint"  # ip:port of the pool endpoint Sluice picked

_HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_BACKEND_CIRCUIT_LIMIT = 10000


def socket_address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _cluster(
    name: str,
    host: str,
    port: int,
    *,
    connect_timeout: datetime.timedelta,
    protocol: HttpProtocolOptionsExplicitHttpConfig,
    max_requests: int,
) -> Cluster:
    static = _is_ip(host)
    limit = CircuitBreakersThresholds(
        max_connections=max_requests,
        max_pending_requests=max_requests,
        max_requests=max_requests,
    )
    cluster = Cluster(
        name=name,
        type=ClusterDiscoveryType.STATIC if static else ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=connect_timeout,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                LocalityLbEndpoints(
                    lb_endpoints=[LbEndpoint(endpoint=Endpoint(address=socket_address(host, port)))]
                )
            ],
        ),
        circuit_breakers=CircuitBreakers(thresholds=[limit]),
        typed_extension_protocol_options={
            _HTTP_PROTOCOL_OPTIONS: Any.pack(HttpProtocolOptions(explicit_http_config=protocol)),
        },
    )
    if not static:
        cluster.dns_lookup_family = ClusterDnsLookupFamily.V4_PREFERRED
    return cluster


def extproc_cluster(name: str, host: str, port: int, max_requests: int,
                    more: tuple[tuple[str, int], ...] = ()) -> Cluster:
    """The ext_proc cluster; ``more`` adds replicas as endpoints (Envoy balances the streams)."""
    # No HTTP/2 connection_keepalive: grpc-core servers answer pings more frequent than
    # 5 min on an idle connection with GOAWAY (too_many_pings). ext_proc runs next to Envoy,
    # so a dead server shows up as a reset connection anyway.
    cluster = _cluster(
        name,
        host,
        port,
        connect_timeout=datetime.timedelta(milliseconds=250),
        protocol=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        ),
        max_requests=max_requests,
    )
    endpoints = cluster.load_assignment.endpoints[0].lb_endpoints
    endpoints.extend(LbEndpoint(endpoint=Endpoint(address=socket_address(h, p))) for h, p in more)
    return cluster


def backend_cluster(name: str, host: str, port: int, connect_timeout: datetime.timedelta) -> Cluster:
    return _cluster(
        name,
        host,
        port,
        connect_timeout=connect_timeout,
        protocol=HttpProtocolOptionsExplicitHttpConfig(
            http_protocol_options=Http1ProtocolOptions()
        ),
        max_requests=_BACKEND_CIRCUIT_LIMIT,
    )


def pool_cluster(name: str, connect_timeout: datetime.timedelta) -> Cluster:
    """A pool's cluster: ORIGINAL_DST, connecting to the ip:port in ``x-sluice-endpoint``.

    Sluice picks the endpoint (extproc.policy.placement) and sets the header, so the
    endpoints can change with the policy without re-rendering Envoy's config; one
    cluster per endpoint would need a new bootstrap (or xDS) for every change. Envoy
    keeps a host per destination seen and drops it after ``cleanup_interval`` idle.
    """
    cluster = _cluster(name, "127.0.0.1", 1, connect_timeout=connect_timeout,
                       protocol=HttpProtocolOptionsExplicitHttpConfig(http_protocol_options=Http1ProtocolOptions()),
                       max_requests=_BACKEND_CIRCUIT_LIMIT)
    cluster.type = ClusterDiscoveryType.ORIGINAL_DST
    cluster.lb_policy = ClusterLbPolicy.CLUSTER_PROVIDED
    cluster.load_assignment = None
    cluster.original_dst_lb_config = ClusterOriginalDstLbConfig(use_http_header=True, http_header_name=ENDPOINT_HEADER)
    cluster.cleanup_interval = datetime.timedelta(seconds=60)
    return cluster
