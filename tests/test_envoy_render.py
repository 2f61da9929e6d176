"""The Envoy bootstrap Sluice renders (extproc.envoy): filters, ext_proc modes and timeouts,
listener, routes, clusters, the drain, pools and their retries, local replies; read, not run
(one check has the binary validate a pool's config)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.procs import envoy_binary
from extproc.envoy.bootstrap import (
    ACCESS_LOG_FORMAT,
    BACKEND_HEADER,
    DRAIN_CLUSTER,
    EXTPROC_CLUSTER,
    EXTPROC_FILTER,
    HEADER,
    BackendRoute,
    EnvoyOptions,
    buffer_limit_bytes,
    gateway_options,
    render_bootstrap,
    render_yaml,
    write_config,
)
from extproc.envoy.edge import KEY_GUARD_ROUTE, STRIP_FILTER
from extproc.envoy.eds import render as render_eds
from extproc.envoy.eds import write_if_changed
from extproc.envoy.headers import DRAIN_PATH, ENDPOINT_HEADER, LIMIT_HEADER, UPSTREAM_ATTRIBUTE
from extproc.envoy.replies import ENVOY_REPLIES
from extproc.openai_api.body import ENDPOINTS
from tests.envoy_config import BACKENDS, ERROR_KEYS, clusters, ext_proc, hcm


def test_filters_are_the_header_strip_then_ext_proc_then_router() -> None:
    names = [f["name"] for f in hcm(render_bootstrap(BACKENDS, EnvoyOptions()))["http_filters"]]
    # usage_trailers (the default): the Lua filter hiding the injected usage chunk sits
    # between them, so on the response path it runs before ext_proc. The client's
    # x-sluice-* headers are gone before any of them (extproc.envoy.edge).
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.lua", "envoy.filters.http.router"]
    streamed = EnvoyOptions(response_processing="streamed")
    names = [f["name"] for f in hcm(render_bootstrap(BACKENDS, streamed))["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.router"]


def test_usage_trailers_reads_usage_upstream_and_streamed_does_not() -> None:
    cfg = render_bootstrap(BACKENDS, EnvoyOptions())
    for b in BACKENDS:
        (opts,) = clusters(cfg)[b.name]["typed_extension_protocol_options"].values()
        assert [f["name"] for f in opts["http_filters"]] == [
            "envoy.filters.http.ai_protocol_manager", "envoy.filters.http.upstream_codec"]
    assert "http_filters" not in next(iter(clusters(cfg)[EXTPROC_CLUSTER]["typed_extension_protocol_options"]
                                           .values()))
    assert ext_proc(cfg)["metadata_options"]["forwarding_namespaces"] == {"typed": ["envoy.ai.token_usage"]}
    streamed = render_bootstrap(BACKENDS, EnvoyOptions(response_processing="streamed"))
    for c in clusters(streamed).values():
        assert "http_filters" not in next(iter(c["typed_extension_protocol_options"].values()))
    assert "forwarding_namespaces" not in ext_proc(streamed)["metadata_options"]
    with pytest.raises(ValueError, match="response_processing"):
        render_bootstrap(BACKENDS, EnvoyOptions(response_processing="buffered"))


def test_ext_proc_modes_timeouts_and_fail_closed_defaults() -> None:
    cfg = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions()))
    # The request side only, under every response_processing (one request side: headers
    # SEND, answered once the STREAMED body is in): the routes Sluice reads turn the
    # response side on (test_routes_one_per_backend_header_then_catch_all), so a reply Envoy
    # makes for a request ext_proc never saw (an edge rate limit's 429) opens no stream.
    request_only = {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "STREAMED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert cfg["processing_mode"] == request_only
    assert "response_attributes" not in cfg
    streamed = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions(response_processing="streamed")))
    assert streamed["processing_mode"] == request_only
    assert streamed["response_attributes"] == ["response.code"]
    logged = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions(response_processing="access_log")))
    assert logged["processing_mode"] == request_only
    # access_log: nothing of the response blocks on ext_proc
    assert "response_attributes" not in logged
    assert "forwarding_namespaces" not in logged["metadata_options"]
    assert cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    assert cfg["grpc_service"]["timeout"] == "2s"
    assert cfg["message_timeout"] == "2s"
    assert cfg["max_message_timeout"] == "120s"
    assert cfg.get("failure_mode_allow", False) is False
    assert cfg["status_on_error"] == {"code": "ServiceUnavailable"}
    for c in (cfg, streamed, logged):
        # Envoy sends the body without waiting for the headers' answer, and keeps
        # content-length (STREAMED drops it otherwise). It ignores mode_override then; the
        # override Sluice sends (the routes' modes) is allowed for a filter without the flag.
        assert c["send_body_without_waiting_for_header_response"] is True
        assert c["allow_content_length_header"] is True
        assert c["allow_mode_override"] is True
    assert cfg.get("route_cache_action", "DEFAULT") == "DEFAULT"
    assert not cfg.get("disable_clear_route_cache", False)


def test_options_reach_ext_proc() -> None:
    opts = EnvoyOptions(
        message_timeout_ms=350,
        max_message_timeout_ms=30000,
        failure_mode_allow=True,
        status_on_error=500,
    )
    cfg = ext_proc(render_bootstrap(BACKENDS, opts))
    assert cfg["message_timeout"] == "0.350s"
    assert cfg["max_message_timeout"] == "30s"
    assert cfg["failure_mode_allow"] is True
    assert cfg["status_on_error"] == {"code": "InternalServerError"}


def test_listener_buffer_exceeds_body_cap() -> None:
    for cap in (1, 64 * 1024, 1 << 20, 8 << 20):
        config = render_bootstrap(BACKENDS, EnvoyOptions(max_body_bytes=cap))
        (listener,) = config["static_resources"]["listeners"]
        limit = listener["per_connection_buffer_limit_bytes"]
        assert limit == buffer_limit_bytes(cap) == max(2 * cap, cap + (1 << 20))
        assert limit > cap


def test_listener_admin_and_hcm() -> None:
    opts = EnvoyOptions(listen_host="0.0.0.0", listen_port=18000, admin_port=19901)
    config = render_bootstrap(BACKENDS, opts)
    assert config["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 19901,
    }
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 18000}
    manager = hcm(config)
    assert manager.get("codec_type", "AUTO") == "AUTO"  # the enum default is omitted
    assert manager["stream_idle_timeout"] == "300s"
    assert manager["request_timeout"] == "120s"
    assert manager["request_headers_timeout"] == "10s"
    (log,) = manager["access_log"]
    fields = log["typed_config"]["log_format"]["json_format"]
    for operator in ("%RESPONSE_CODE%", "%RESPONSE_FLAGS%", "%DURATION%", "%UPSTREAM_CLUSTER%"):
        assert operator in fields.values()
    assert fields["sluice_reason"] == "%RESP(X-SLUICE-REASON)%"
    assert "access_log" not in hcm(render_bootstrap(BACKENDS, EnvoyOptions(access_log=False)))


def _route_mode(route: dict[str, Any]) -> dict[str, str] | None:
    override = route.get("typed_per_filter_config", {}).get(EXTPROC_FILTER)
    return None if override is None else override["overrides"]["processing_mode"]


def test_routes_one_per_backend_header_then_catch_all() -> None:
    request_side = {"request_header_mode": "SEND", "request_body_mode": "STREAMED",
                    "request_trailer_mode": "SKIP"}
    # The response side each response_processing needs, on the endpoints Sluice reads.
    response_side = {
        "usage_trailers": {**request_side, "response_header_mode": "SEND", "response_trailer_mode": "SEND"},
        "streamed": {**request_side, "response_header_mode": "SKIP", "response_body_mode": "STREAMED",
                     "response_trailer_mode": "SKIP"},
        "access_log": None,  # the filter's static mode: nothing of the response
    }
    for mode, expected in response_side.items():
        opts = EnvoyOptions(response_processing=mode)
        route_config = hcm(render_bootstrap(BACKENDS, opts))["route_config"]
        (vhost,) = route_config["virtual_hosts"]
        routes = vhost["routes"]
        assert len(routes) == len(BACKENDS) + 5
        assert routes.pop(0)["name"] == KEY_GUARD_ROUTE  # first: Envoy's own 401 (test_edge_config)
        assert routes.pop(0)["name"] == "drain_oversized_upload"  # then: see test_drain_route
        for backend, route in zip(BACKENDS, routes, strict=False):
            assert route["match"]["headers"] == [
                {"name": BACKEND_HEADER, "string_match": {"exact": backend.name}}
            ]
            assert route["route"]["cluster"] == backend.name
            assert "typed_per_filter_config" not in route
        # Before Sluice routed a request its ext_proc mode comes from the first route it matched.
        reads_body, openai, catch_all = routes[-3:]
        assert reads_body["match"] == {"safe_regex": {"regex": "^(/v1/embeddings|/v1/responses)$"}}
        # the Responses API and embeddings: Sluice reads the body (Envoy's usage filter cannot)
        assert _route_mode(reads_body) == (response_side["streamed"] if mode == "streamed" else {
            **request_side, "response_header_mode": "SEND", "response_body_mode": "STREAMED",
            "response_trailer_mode": "SEND"})
        assert openai["match"] == {"safe_regex": {"regex": "^(/v1/chat/completions|/v1/completions)$"}}
        assert _route_mode(openai) == expected
        assert catch_all["match"] == {"prefix": "/"}
        # /v1/models and the pass-through paths: the headers only, nothing of the body or response
        assert _route_mode(catch_all) == {
            "request_header_mode": "SEND", "request_trailer_mode": "SKIP", "response_header_mode": "SKIP",
            "response_trailer_mode": "SKIP"}
        for route in (reads_body, openai, catch_all):
            assert route["route"]["cluster"] == BACKENDS[0].name
        for route in routes:
            # generations stream for minutes; response_timeout_s bounds them (and a log settle's wait)
            assert route["route"]["timeout"] == "600s"
            assert route["route"]["idle_timeout"] == "300s"
        # clients cannot choose a backend, and the choice is not sent upstream
        assert route_config["internal_only_headers"] == [BACKEND_HEADER, LIMIT_HEADER]
        assert route_config["request_headers_to_remove"] == [BACKEND_HEADER]
    no_limit = hcm(render_bootstrap(BACKENDS, EnvoyOptions(response_timeout_s=0)))["route_config"]
    assert all(r["route"]["timeout"] == "0s" for r in no_limit["virtual_hosts"][0]["routes"][2:])


def test_the_routes_modes_are_the_mode_override_sluice_answers_with() -> None:
    """One definition (extproc.wire.messages): what the routes tell Envoy 1.40 and what the
    answer to the request headers says for a filter that takes a mode_override."""
    from google.protobuf import json_format

    from extproc.wire.messages import response_mode

    def wire(kind: str, rp: str) -> dict[str, str]:
        return json_format.MessageToDict(response_mode(kind, rp), preserving_proto_field_name=True)

    for rp in ("usage_trailers", "streamed"):
        routes = hcm(render_bootstrap(BACKENDS, EnvoyOptions(response_processing=rp)))[
            "route_config"]["virtual_hosts"][0]["routes"]
        reads_body, openai = routes[-3], routes[-2]
        assert _route_mode(openai) == wire("chat", rp)
        assert _route_mode(reads_body) == wire("responses", rp) == wire("embeddings", rp)
    static = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions(response_processing="access_log")))
    assert static["processing_mode"] == wire("chat", "access_log")


def test_clusters() -> None:
    opts = EnvoyOptions(extproc_host="extproc", extproc_port=50052)
    by_name = clusters(render_bootstrap(BACKENDS, opts))
    assert list(by_name) == [EXTPROC_CLUSTER, "sim", "big", DRAIN_CLUSTER]

    ext = by_name[EXTPROC_CLUSTER]
    assert ext["type"] == "STRICT_DNS"  # a host name, not an IP
    protocol = ext["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in protocol["explicit_http_config"]
    (limits,) = ext["circuit_breakers"]["thresholds"]
    for key in ("max_connections", "max_pending_requests", "max_requests"):
        assert limits[key] == opts.extproc_max_requests > 1024
    address = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "extproc", "port_value": 50052}

    assert by_name["sim"]["type"] == "STATIC"
    assert by_name["big"]["type"] == "STRICT_DNS"
    for name in ("sim", "big"):
        backend = by_name[name]
        assert backend["connect_timeout"] == "2s"
        protocol = backend["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        assert "http_protocol_options" in protocol["explicit_http_config"]
        (limits,) = backend["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] > 1024


def test_drain_route() -> None:
    cap = 64 * 1024
    opts = EnvoyOptions(max_body_bytes=cap, drain_host="extproc", drain_port=9200)
    config = render_bootstrap(BACKENDS, opts)
    manager = hcm(config)
    drain = manager["route_config"]["virtual_hosts"][0]["routes"][1]
    over_cap, not_rerouted = drain["match"]["headers"]
    # a declared body over the cap (an Int64Range: start inclusive, end exclusive)
    assert over_cap == {"name": "content-length", "range_match": {"start": str(cap + 1), "end": str(1 << 62)}}
    # a request ext_proc rerouted after rewriting its body is never re-matched here
    assert not_rerouted == {"name": BACKEND_HEADER, "present_match": True, "invert_match": True}
    assert drain["route"]["cluster"] == DRAIN_CLUSTER
    # only the endpoints Sluice reads; pass-through paths keep streaming any size
    regex = re.compile(drain["match"]["safe_regex"]["regex"])
    assert all(regex.fullmatch(path) for path in ENDPOINTS)
    assert not any(regex.fullmatch(p) for p in ("/v1/files", "/v1/chat/completions/x", "/v1/embeddingsx"))
    assert drain["route"]["regex_rewrite"]["substitution"] == DRAIN_PATH
    # every filter but the router and the header strip is off: ext_proc never sees the upload
    filters = [f["name"] for f in manager["http_filters"]]
    kept = {"envoy.filters.http.router", STRIP_FILTER}
    assert set(drain["typed_per_filter_config"]) == set(filters) - kept
    assert EXTPROC_FILTER in drain["typed_per_filter_config"]
    for per_filter in drain["typed_per_filter_config"].values():
        assert per_filter == {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
    (limit,) = drain["request_headers_to_add"]
    assert limit["header"] == {"key": LIMIT_HEADER, "value": str(cap)}
    address = clusters(config)[DRAIN_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"] == {"address": "extproc", "port_value": 9200}


def test_edge_settings_come_from_the_gateway_policy() -> None:
    from extproc.policy.schema import Gateway

    gw = Gateway(request_timeout_s=45, request_headers_timeout_s=3, max_connections=77, trusted_proxy_hops=2,
                 drain_timeout_s=9, max_body_bytes=4096)
    config = render_bootstrap(BACKENDS, EnvoyOptions(**gateway_options(gw)))
    manager = hcm(config)
    assert manager["use_remote_address"] is True
    assert manager["xff_num_trusted_hops"] == 2
    assert not manager.get("preserve_external_request_id", False)
    assert manager["generate_request_id"] is True
    assert manager["request_timeout"] == "45s"
    assert manager["request_headers_timeout"] == "3s"
    (monitor,) = config["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == "77"
    assert config["admin"]["ignore_global_conn_limit"] is True  # health checks still answer
    # the access log never records a query string (API keys travel there)
    assert ACCESS_LOG_FORMAT["path"].startswith("%REQ_WITHOUT_QUERY(")
    log_format = manager["access_log"][0]["typed_config"]["log_format"]
    assert log_format["formatters"][0]["name"] == "envoy.formatter.req_without_query"


def test_the_access_log_flush_interval_comes_from_the_gateway_policy() -> None:
    from extproc.policy.schema import build_policy

    def flushes(doc_gateway: dict[str, object]) -> list[str]:
        policy = build_policy({"gateway": {"response_processing": "access_log", **doc_gateway},
                               "backends": [{"name": "b", "address": "127.0.0.1:1",
                                             "models": [{"name": "m", "context_window": 4096}]}],
                               "tiers": {"t": {"tpm": 1000, "rpm": 10}}, "tenants": []})
        manager = hcm(render_bootstrap(BACKENDS, EnvoyOptions(**gateway_options(policy.gateway))))
        return [log["typed_config"]["common_config"]["buffer_flush_interval"] for log in manager["access_log"]
                if log["name"] == "envoy.access_loggers.http_grpc"]

    assert flushes({}) == ["0.010s"]  # the default
    assert flushes({"access_log_flush_ms": 25}) == ["0.025s"]


def test_envoy_replies_speak_the_error_shape() -> None:
    mappers = hcm(render_bootstrap(BACKENDS, EnvoyOptions()))["local_reply_config"]["mappers"]
    assert len(mappers) == len(ENVOY_REPLIES)
    for reply, mapper in zip(ENVOY_REPLIES, mappers, strict=True):
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == ERROR_KEYS and error["param"] is None and error["code"] == reply.reason
        assert {"key": "x-sluice-reason", "value": reply.reason} in [h["header"] for h in mapper["headers_to_add"]]
    unavailable = mappers[[r.reason for r in ENVOY_REPLIES].index("gateway_unavailable")]
    assert unavailable["status_code"] == 503  # also when Envoy would answer 504 (message timeout)
    assert {"key": "retry-after", "value": "1"} in [h["header"] for h in unavailable["headers_to_add"]]


@pytest.mark.parametrize(
    "backends",
    [
        (),
        (BackendRoute("a", "127.0.0.1", 1), BackendRoute("a", "127.0.0.1", 2)),
        (BackendRoute(EXTPROC_CLUSTER, "127.0.0.1", 1),),
        (BackendRoute(DRAIN_CLUSTER, "127.0.0.1", 1),),
    ],
)
def test_bad_backend_lists_are_refused(backends: tuple[BackendRoute, ...]) -> None:
    with pytest.raises(ValueError):
        render_bootstrap(backends, EnvoyOptions())


def test_yaml_has_header_and_round_trips(tmp_path: Path) -> None:
    text = render_yaml(BACKENDS, EnvoyOptions())
    assert text.startswith(HEADER)
    assert yaml.safe_load(text) == render_bootstrap(BACKENDS, EnvoyOptions())
    path = write_config(tmp_path / "envoy" / "sluice.yaml", BACKENDS, EnvoyOptions())
    assert path.read_text() == text



def test_response_headers_come_from_request_side_metadata() -> None:
    boot = render_bootstrap([BackendRoute("b1", "127.0.0.1", 9000)], EnvoyOptions())
    text = yaml.safe_dump(boot)
    # Response headers are not a blocking round trip: the status comes as an attribute
    # and x-ratelimit-* / x-sluice-degraded from the metadata the body answer sets.
    assert "response.code" in text
    assert "receiving_namespaces" in text and "sluice" in text
    for name in ("x-ratelimit-remaining-tokens", "x-sluice-degraded"):
        assert f"%DYNAMIC_METADATA(sluice:{name})%" in text


def test_a_pool_is_an_eds_cluster_balanced_by_the_hosts_in_x_sluice_endpoint(tmp_path: Path) -> None:
    backends = (BackendRoute("pool", "127.0.0.1", 8000, pool=True), BackendRoute("big", "localhost", 8001))
    opts = EnvoyOptions(eds_dir=str(tmp_path / "eds"))
    cfg = render_bootstrap(backends, opts)
    pool = clusters(cfg)["pool"]
    assert pool["type"] == "EDS" and "lb_policy" not in pool and "load_assignment" not in pool
    assert "original_dst_lb_config" not in pool
    assert pool["eds_cluster_config"]["eds_config"] == {
        "resource_api_version": "V3",
        "path_config_source": {
            "path": f"{tmp_path}/eds/pool.eds.yaml",
            "watched_directory": {"path": f"{tmp_path}/eds"},
        },
    }
    (lb,) = pool["load_balancing_policy"]["policies"]
    assert lb["typed_extension_config"]["name"] == "envoy.load_balancing_policies.override_host"
    override = lb["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [{"header": ENDPOINT_HEADER}]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"
    # Envoy's default of 3 retries in flight would turn a 4th concurrent re-pick into a 503.
    (limits,) = pool["circuit_breakers"]["thresholds"]
    assert limits["max_retries"] == limits["max_requests"] > 1024
    # The usage path's upstream filters sit on whatever cluster serves the request.
    (protocol,) = pool["typed_extension_protocol_options"].values()
    assert [f["name"] for f in protocol["http_filters"]] == [
        "envoy.filters.http.ai_protocol_manager", "envoy.filters.http.upstream_codec"]
    assert clusters(cfg)["big"]["type"] == "STRICT_DNS"
    # write_config's default: the endpoint files beside the config.
    path = write_config(tmp_path / "envoy.yaml", backends, EnvoyOptions())
    source = clusters(yaml.safe_load(path.read_text()))["pool"]["eds_cluster_config"]["eds_config"]
    assert source["path_config_source"]["path"] == f"{tmp_path}/pool.eds.yaml"
    # Envoy refuses a config whose endpoint file is missing; with the file it validates.
    write_if_changed(tmp_path / "pool.eds.yaml", render_eds("pool", ["127.0.0.1:8000", "127.0.0.1:8002"]))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_pool_routes_retry_and_only_on_a_refused_connection() -> None:
    backends = (BackendRoute("pool", "127.0.0.1", 8000, pool=True), BackendRoute("big", "127.0.0.1", 8001))
    for order in (backends, backends[::-1]):
        (vhost,) = hcm(render_bootstrap(order, EnvoyOptions(repick_backoff_ms=3)))["route_config"]["virtual_hosts"]
        for route in vhost["routes"][2:]:  # after the key guard and the drain route
            if route["route"]["cluster"] == "pool":
                assert route["route"]["retry_policy"] == {
                    "retry_on": "connect-failure", "num_retries": 1,
                    "retry_back_off": {"base_interval": "0.003s", "max_interval": "0.003s"}}
            else:
                assert "retry_policy" not in route["route"]
            # who served comes as the upstream.address attribute: no header for clients to see
            assert "response_headers_to_add" not in route
        assert "retry_policy" not in vhost["routes"][1]["route"]  # the drain
    for mode in ("usage_trailers", "streamed"):
        cfg = ext_proc(render_bootstrap(backends, EnvoyOptions(response_processing=mode)))
        assert UPSTREAM_ATTRIBUTE in cfg["response_attributes"], mode


def test_ext_proc_may_set_x_envoy_max_retries_and_no_other_envoy_header_but_the_retry_ones() -> None:
    rules = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions()))["mutation_rules"]
    assert rules["allow_all_routing"] is False and rules["allow_envoy"] is False
    allowed = re.compile(rules["allow_expression"]["regex"])  # Envoy matches the whole name
    assert allowed.fullmatch("x-envoy-max-retries")
    assert not any(allowed.fullmatch(h) for h in ("x-envoy-original-path", "x-envoy-internal",
                                                  "x-envoy-expected-rq-timeout-ms", "x-envoy-decorator-operation"))

