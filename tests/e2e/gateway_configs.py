"""Gateways' Envoy configs in front of Sluice as their endpoint picker, on this machine's ports.

``gie`` and ``llmd`` are the vendored files under ``gateways/`` (their headers name source,
commit and licence), with only addresses and ports changed (``relocate``). The other two
are written here from the code that generates them, on top of GIE's file:

* ``aigw``: what Envoy AI Gateway's extension server makes of an InferencePool
  (``internal/extensionserver/inferencepool.go``: the picker cluster STRICT_DNS over TLS
  with an empty validation context and no health check, the filter with
  ``failure_mode_allow: false``, ``message_timeout: 300s``, both bodies FULL_DUPLEX_STREAMED,
  or BUFFERED with its ``processing-body-mode: buffered`` annotation; the pool ORIGINAL_DST
  on the header, ``connect_timeout: 10s``);
* ``istio``: what istiod makes of one (``pilot/pkg/xds/filters/filters.go``'s
  ``InferencePoolExtProc`` with ``envoy.lb`` received and forwarded, the per-route
  ``ExtProcPerRoute`` of ``route/route.go`` with the FULL_DUPLEX modes and the pool's
  ``failureMode``, and ``cluster_builder.go``'s ``override_host`` policy reading the metadata,
  writing the served host to ``envoy.lb`` / ``x-gateway-destination-endpoint-served``,
  round-robin when no host is named). The pool's endpoints are a STATIC list here
  (istiod sends them by EDS).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

GATEWAYS = Path(__file__).parent / "gateways"
VENDORED = {"gie": "gie-envoy.yaml", "llmd": "llmd-envoy.yaml"}
# The picker's host name in each file (a Kubernetes Service), and the ports that are theirs.
PICKER_HOSTS = ("vllm-qwen3-32b-epp.$E2E_NS", "e2e-epp.${NAMESPACE}")
ADMIN, READY, LISTENER, PICKER = 19000, 19001, 8081, 9002


@dataclass(frozen=True)
class Ports:
    admin: int
    ready: int
    listener: int
    picker: int


def vendored(name: str) -> dict[str, Any]:
    """The bootstrap inside the vendored ConfigMap, as its authors wrote it."""
    for doc in yaml.safe_load_all((GATEWAYS / VENDORED[name]).read_text()):
        if doc and doc.get("kind") == "ConfigMap":
            return yaml.safe_load(doc["data"]["envoy.yaml"])
    raise LookupError(f"no ConfigMap in {VENDORED[name]}")


def relocate(cfg: dict[str, Any], ports: Ports) -> dict[str, Any]:
    """The same config listening on loopback ports and reaching the picker here; nothing else."""
    port_map = {ADMIN: ports.admin, READY: ports.ready, LISTENER: ports.listener, PICKER: ports.picker}
    out = copy.deepcopy(cfg)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            sa = node.get("socket_address")
            if isinstance(sa, dict):
                if sa.get("address") in ("0.0.0.0", *PICKER_HOSTS):
                    sa["address"] = "127.0.0.1"
                if sa.get("port_value") in port_map:
                    sa["port_value"] = port_map[sa["port_value"]]
            eg = node.get("envoy_grpc")
            if isinstance(eg, dict) and "authority" in eg:
                eg["authority"] = f"127.0.0.1:{ports.picker}"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(out)
    return out


def _listener(cfg: dict[str, Any]) -> dict[str, Any]:
    return next(li for li in cfg["static_resources"]["listeners"] if li["name"] == "vllm")


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return _listener(cfg)["filter_chains"][0]["filters"][0]["typed_config"]


def ext_proc_filter(cfg: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in _hcm(cfg)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


def _cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def aigw(cfg: dict[str, Any], body_mode: str = "FULL_DUPLEX_STREAMED") -> dict[str, Any]:
    """GIE's relocated config with the filter and clusters Envoy AI Gateway generates."""
    out = copy.deepcopy(cfg)
    f = ext_proc_filter(out)
    f.pop("message_timeout", None)
    f["grpc_service"]["envoy_grpc"].pop("authority", None)
    f["grpc_service"].pop("timeout", None)
    f.update({"failure_mode_allow": False, "message_timeout": "300s", "allow_mode_override": False,
              "processing_mode": {"request_header_mode": "SEND", "request_body_mode": body_mode,
                                  "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                                  "response_body_mode": body_mode, "response_trailer_mode": "SEND"}})
    ep = _cluster(out, "ext_proc")
    ep.pop("health_checks", None)
    ep.pop("circuit_breakers", None)
    ep["connect_timeout"] = "10s"
    ep["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"] = {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}
    _cluster(out, "original_destination_cluster")["connect_timeout"] = "10s"
    return out


def istio(cfg: dict[str, Any], engines: list[tuple[str, int]], fail_open: bool = True) -> dict[str, Any]:
    """GIE's relocated config with istiod's filter, per-route override and override_host pool."""
    out = copy.deepcopy(cfg)
    hcm = _hcm(out)
    grpc = copy.deepcopy(ext_proc_filter(out)["grpc_service"])
    grpc["envoy_grpc"].pop("authority", None)
    filt = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    filt["typed_config"] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "dummy"}, "timeout": "10s"},
        "failure_mode_allow": True,
        "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
        "message_timeout": "1000s",
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]},
                             "forwarding_namespaces": {"untyped": ["envoy.lb"]}},
    }
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["route"]["cluster"] = "inference_pool"
    # istiod's default retry policy (networking/core/route/retry): what walks the list.
    route["route"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2, "retriable_status_codes": [503], "host_selection_retry_max_attempts": 5,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
    }
    route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {
            "failure_mode_allow": fail_open,
            "grpc_service": grpc,
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                                "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"},
        }}}
    # istiod checks no picker actively (outlier detection only).
    _cluster(out, "ext_proc").pop("health_checks", None)
    lb_key = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    served_key = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]}
    out["static_resources"]["clusters"] = [c for c in out["static_resources"]["clusters"]
                                           if c["name"] != "original_destination_cluster"]
    out["static_resources"]["clusters"].append({
        "name": "inference_pool", "type": "STATIC", "connect_timeout": "10s", "lb_policy": "CLUSTER_PROVIDED",
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": lb_key}],
                "selected_host_key": served_key,
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                                              "round_robin.v3.RoundRobin"}}}]},
            }}}]},
        "load_assignment": {"cluster_name": "inference_pool", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in engines]}]},
    })
    return out


def fail_open(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config for a pool whose ``failureMode`` is FailOpen (the filter lets traffic by)."""
    out = copy.deepcopy(cfg)
    ext_proc_filter(out)["failure_mode_allow"] = True
    return out


def picker_by_eds(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The picker's cluster fed from an endpoints file, as a Kubernetes Service's EndpointSlices
    feed a gateway: emptying the file is the picker's pods gone (conformance's
    ``MakeServiceUnavailable``). Everything else about the cluster stays."""
    out = copy.deepcopy(cfg)
    c = _cluster(out, "ext_proc")
    c["type"] = "EDS"
    c.pop("load_assignment", None)
    c["eds_cluster_config"] = {"eds_config": {"resource_api_version": "V3", "path_config_source": {
        "path": str(path), "watched_directory": {"path": str(path.parent)}}}}
    return out
