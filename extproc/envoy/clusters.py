"""The clusters of the Envoy bootstrap: the ext_proc server (HTTP/2) and one HTTP/1.1
cluster per backend, each with one endpoint and circuit-breaker thresholds; a pool's
cluster takes its endpoints from a file (EDS, written by ``extproc.envoy.eds``).

Takes plain values rather than ``EnvoyOptions`` (``extproc.envoy.options``);
``extproc.envoy.bootstrap``, which assembles the bootstrap, passes them.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    ClusterDnsLookupFamily,
    ClusterEdsClusterConfig,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    ApiVersion,
    ConfigSource,
    HealthCheck,
    HealthCheckGrpcHealthCheck,
    Http1ProtocolOptions,
    Http2ProtocolOptions,
    PathConfigSource,
    SocketAddress,
    TypedExtensionConfig,
    WatchedDirectory,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
    OverrideHost,
    OverrideHostOverrideHostSource,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.google.protobuf import Any

# ENDPOINT_HEADER: ip:port of the pool endpoint Sluice picked, then (comma-separated) its
# second choice; defined beside the rest of that contract.
from extproc.envoy.headers import ENDPOINT_HEADER

__all__ = ["DRAIN_CLUSTER", "ENDPOINT_HEADER", "backend_cluster", "eds_path",
           "extproc_cluster", "extproc_health", "pool_cluster", "socket_address"]

DRAIN_CLUSTER = "sluice_drain"  # extproc's admin port, where oversized uploads are drained

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


def extproc_health(interval_s: float, unhealthy_threshold: int) -> tuple[HealthCheck, OutlierDetection]:
    """How Envoy stops sending ext_proc streams to a replica that is dead, frozen or draining.

    Active gRPC health checks (``grpc.health.v1``, served by extproc/wire/health.py) every
    ``interval_s``, also while the cluster has no traffic yet (Envoy's default would be
    60 s, so a replica started after Envoy would wait that long): ``unhealthy_threshold``
    failed or timed-out checks, or one NOT_SERVING answer (a draining replica), take a
    replica out; one passing check brings it back. Outlier detection ejects a replica as
    soon as that many streams in a row fail to connect or end in a gateway error (a
    SIGKILLed replica, between two checks); its next passing check un-ejects it (so do
    Envoy's default 5 other gRPC errors in a row, such as INTERNAL: ``*_5xx`` fields are
    left alone because betterproto2 renders them as ``*_5_xx``). With more than half
    the replicas out, Envoy's panic threshold (50 %) spreads over all of them.
    """
    interval = datetime.timedelta(seconds=interval_s)
    check = HealthCheck(
        timeout=interval,
        interval=interval,
        no_traffic_interval=interval,
        unhealthy_threshold=unhealthy_threshold,
        healthy_threshold=1,
        grpc_health_check=HealthCheckGrpcHealthCheck(),
    )
    outlier = OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=unhealthy_threshold,
        enforcing_consecutive_local_origin_failure=100,
        consecutive_gateway_failure=unhealthy_threshold,
        enforcing_consecutive_gateway_failure=100,
        enforcing_success_rate=0,
        enforcing_local_origin_success_rate=0,
        interval=interval,
        max_ejection_percent=100,
    )
    return check, outlier


def extproc_cluster(name: str, host: str, port: int, max_requests: int,
                    more: tuple[tuple[str, int], ...] = (), health_interval_s: float = 1.0,
                    unhealthy_threshold: int = 2) -> Cluster:
    """The ext_proc cluster; ``more`` adds replicas as endpoints (Envoy balances the streams).

    Health-checked and outlier-detected (``extproc_health``), with one endpoint too: a
    lone replica that is down is then down in Envoy's stats, and Envoy's panic threshold
    still sends it every stream, as before.
    """
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
    check, outlier = extproc_health(health_interval_s, unhealthy_threshold)
    cluster.health_checks = [check]
    cluster.outlier_detection = outlier
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


def eds_path(directory: str | Path, cluster: str) -> Path:
    """Where a pool cluster's endpoints are: ``<directory>/<cluster>.eds.yaml``."""
    return Path(directory) / f"{cluster}.eds.yaml"


def pool_cluster(name: str, connect_timeout: datetime.timedelta, eds_dir: str) -> Cluster:
    """A pool's cluster: EDS from a file, balanced by the hosts listed in ``x-sluice-endpoint``.

    Sluice picks the endpoint (extproc.policy.placement) and names it, then its second
    choice, in the header (``ip:port,ip:port``); the override_host policy sends the first
    attempt to the first and a retry (a refused connection, see the pool routes) to the
    next. A listed host that is not in the cluster's endpoint set is skipped; once the list
    runs out (or without the header) round robin picks, which is why extproc sends
    ``x-envoy-max-retries: 0`` when it has no second choice.

    The set is read from ``<eds_dir>/<name>.eds.yaml`` (a DiscoveryResponse that
    ``extproc.envoy.eds`` writes on every policy reload; Envoy re-reads it when a file is
    moved into ``eds_dir``), so the endpoints change with the policy without re-rendering
    Envoy's config. The ORIGINAL_DST cluster used before connected to whatever the header
    named, one host per request: a retry went to the same dead address, never elsewhere.
    """
    cluster = _cluster(name, "127.0.0.1", 1, connect_timeout=connect_timeout,
                       protocol=HttpProtocolOptionsExplicitHttpConfig(http_protocol_options=Http1ProtocolOptions()),
                       max_requests=_BACKEND_CIRCUIT_LIMIT)
    # Envoy allows 3 retries in flight per cluster by default (max_retries): a fourth
    # request refused at once got a 503 (response flags UO,UF) instead of its re-pick.
    # Each request retries at most once, so the limit is the request limit.
    cluster.circuit_breakers.thresholds[0].max_retries = _BACKEND_CIRCUIT_LIMIT
    cluster.type = ClusterDiscoveryType.EDS
    cluster.load_assignment = None
    cluster.eds_cluster_config = ClusterEdsClusterConfig(eds_config=ConfigSource(
        resource_api_version=ApiVersion.V3,
        path_config_source=PathConfigSource(path=str(eds_path(eds_dir, name)),
                                            watched_directory=WatchedDirectory(path=eds_dir))))
    fallback = LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=TypedExtensionConfig(
        name="envoy.load_balancing_policies.round_robin", typed_config=Any.pack(RoundRobin())))])
    override = OverrideHost(override_host_sources=[OverrideHostOverrideHostSource(header=ENDPOINT_HEADER)],
                            fallback_policy=fallback)
    cluster.load_balancing_policy = LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(
        typed_extension_config=TypedExtensionConfig(name="envoy.load_balancing_policies.override_host",
                                                    typed_config=Any.pack(override)))])
    return cluster
