"""The rendered Envoy bootstrap: its shape, and the real Envoy binary accepting and running it."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

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
from extproc.envoy.eds import render as render_eds
from extproc.envoy.eds import write_if_changed
from extproc.envoy.headers import DRAIN_PATH, ENDPOINT_HEADER, LIMIT_HEADER, UPSTREAM_ATTRIBUTE
from extproc.envoy.replies import ENVOY_REPLIES
from extproc.openai_api.body import ENDPOINTS
from extproc.wire import messages as msg
from tests.waiting import eventually

BACKENDS = (
    BackendRoute("sim", "127.0.0.1", 8000, ("llama-3-8b",)),
    BackendRoute("big", "localhost", 8001),
)
HCM_TYPE = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ERROR_KEYS = {"message", "type", "param", "code"}


def envoy_binary() -> str:
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    pytest.skip("envoy binary not found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hcm(config: dict) -> dict:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (network_filter,) = chain["filters"]
    assert network_filter["typed_config"]["@type"].endswith(HCM_TYPE)
    return network_filter["typed_config"]


def ext_proc(config: dict) -> dict:
    return hcm(config)["http_filters"][0]["typed_config"]


def clusters(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


# --- shape ------------------------------------------------------------------------------


def test_filters_are_ext_proc_then_router() -> None:
    names = [f["name"] for f in hcm(render_bootstrap(BACKENDS, EnvoyOptions()))["http_filters"]]
    # usage_trailers (the default): the Lua filter hiding the injected usage chunk sits
    # between them, so on the response path it runs before ext_proc.
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.lua", "envoy.filters.http.router"]
    streamed = EnvoyOptions(response_processing="streamed")
    names = [f["name"] for f in hcm(render_bootstrap(BACKENDS, streamed))["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]


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
    # usage_trailers: response headers (status, TTFT) and the synthesized trailers
    # (usage), never a body chunk; response_body_mode NONE is the default, left out.
    assert cfg["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SEND",
    }
    assert "response_attributes" not in cfg
    streamed = ext_proc(render_bootstrap(BACKENDS, EnvoyOptions(response_processing="streamed")))
    assert streamed["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED",
        "response_body_mode": "STREAMED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert streamed["response_attributes"] == ["response.code"]
    assert cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    assert cfg["grpc_service"]["timeout"] == "2s"
    assert cfg["message_timeout"] == "2s"
    assert cfg["max_message_timeout"] == "120s"
    assert cfg.get("failure_mode_allow", False) is False
    assert cfg["status_on_error"] == {"code": "ServiceUnavailable"}
    assert cfg["allow_mode_override"] is True
    # content-length must survive so the server can fix it after rewriting a buffered body
    assert not cfg.get("allow_content_length_header", False)
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


def test_routes_one_per_backend_header_then_catch_all() -> None:
    route_config = hcm(render_bootstrap(BACKENDS, EnvoyOptions()))["route_config"]
    (vhost,) = route_config["virtual_hosts"]
    routes = vhost["routes"]
    assert len(routes) == len(BACKENDS) + 2
    assert routes.pop(0)["name"] == "drain_oversized_upload"  # first: see test_drain_route
    for backend, route in zip(BACKENDS, routes, strict=False):
        assert route["match"]["headers"] == [
            {"name": BACKEND_HEADER, "string_match": {"exact": backend.name}}
        ]
        assert route["route"]["cluster"] == backend.name
    catch_all = routes[-1]
    assert catch_all["match"] == {"prefix": "/"}
    assert catch_all["route"]["cluster"] == BACKENDS[0].name
    for route in routes:
        assert route["route"]["timeout"] == "0s"
        assert route["route"]["idle_timeout"] == "300s"
    # clients cannot choose a backend, and the choice is not sent upstream
    assert route_config["internal_only_headers"] == [BACKEND_HEADER, LIMIT_HEADER]
    assert route_config["request_headers_to_remove"] == [BACKEND_HEADER]


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
    drain = manager["route_config"]["virtual_hosts"][0]["routes"][0]
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
    # every filter but the router is off: ext_proc never sees the upload
    filters = [f["name"] for f in manager["http_filters"]]
    assert set(drain["typed_per_filter_config"]) == set(filters) - {"envoy.filters.http.router"}
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


# --- the real binary --------------------------------------------------------------------


@pytest.mark.e2e
def test_envoy_validates_rendered_config(tmp_path: Path) -> None:
    path = write_config(tmp_path / "envoy.yaml", BACKENDS, EnvoyOptions())
    cmd = [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    print(f"envoy --mode validate took {elapsed:.3f} s")
    assert result.returncode == 0, result.stdout + result.stderr


@contextlib.contextmanager
def running_envoy(tmp_path: Path, backends, opts: EnvoyOptions) -> Iterator[Path]:
    """Start Envoy on the rendered config; yields its log file, printed if the test fails."""
    config = write_config(tmp_path / "envoy.yaml", backends, opts)
    log_path = tmp_path / "envoy.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [envoy_binary(), "-c", str(config), "--disable-hot-restart", "-l", "warning"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"envoy exited early:\n{log_path.read_text()}"
            with contextlib.suppress(OSError):
                admin = http.client.HTTPConnection("127.0.0.1", opts.admin_port, timeout=1)
                admin.request("GET", "/ready")
                return admin.getresponse().status == 200
            return False

        eventually(ready, 5, lambda: f"envoy not ready:\n{log_path.read_text()}")
        yield log_path
    except BaseException:
        print(f"--- envoy log ---\n{log_path.read_text()}")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def post(port: int, body: bytes, headers: dict[str, str], chunked: bool = False
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        if chunked:
            conn.request("POST", "/v1/chat/completions", body=iter([body]), headers=headers,
                         encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def local_opts(**overrides) -> EnvoyOptions:
    return EnvoyOptions(
        listen_port=free_port(), admin_port=free_port(), extproc_port=free_port(), **overrides
    )


@pytest.mark.e2e
def test_envoy_fails_closed_without_ext_proc(tmp_path: Path) -> None:
    opts = local_opts()  # nothing listens on extproc_port
    backends = [BackendRoute("sim", "127.0.0.1", free_port())]
    with running_envoy(tmp_path, backends, opts):
        status, headers, body = post(opts.listen_port, b'{"model":"m"}', {})
        assert status == 503 == opts.status_on_error
        assert headers["x-sluice-reason"] == "gateway_unavailable"
        assert headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert set(error) == ERROR_KEYS and error["param"] is None
        assert error["code"] == "gateway_unavailable"
        # an upload over the cap goes to the drain, on extproc's admin port: down as well
        status, headers, body = post(opts.listen_port, b"x" * (opts.max_body_bytes + 1), {})
        assert status == 503, body
        assert headers["x-sluice-reason"] == "gateway_unavailable"
        assert set(json.loads(body)["error"]) == ERROR_KEYS


class SilentProcessor(ext_grpc.ExternalProcessorServicer):
    """Reads the request headers and never answers: Envoy's message_timeout expires."""

    def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        for _ in request_iterator:
            time.sleep(2)
        return iter(())


@pytest.mark.e2e
def test_ext_proc_message_timeout_is_503_with_retry_after(tmp_path: Path) -> None:
    # Envoy answers an expired message_timeout with 504; clients must see what the README
    # promises for "admission control did not answer": 503, Retry-After, gateway_unavailable.
    opts = local_opts(message_timeout_ms=300)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ext_grpc.add_ExternalProcessorServicer_to_server(SilentProcessor(), grpc_server)
    grpc_server.add_insecure_port(f"127.0.0.1:{opts.extproc_port}")
    grpc_server.start()
    backends = [BackendRoute("sim", "127.0.0.1", free_port())]
    try:
        with running_envoy(tmp_path, backends, opts) as log:
            status, headers, body = post(opts.listen_port, b'{"model":"m"}', {})
            assert status == 503, body
            assert headers["x-sluice-reason"] == "gateway_unavailable"
            assert headers["retry-after"] == "1"
            error = json.loads(body)["error"]
            assert set(error) == ERROR_KEYS and error["param"] is None
            assert error["type"] == "server_error"
            eventually(lambda: '"status":503' in log.read_text(), 5, "the 503 in Envoy's access log")
            assert "timeout" in log.read_text()  # it was the message timeout that fired
    finally:
        grpc_server.stop(grace=None)


# A stub ext_proc server and echoing backends: checks the config lets a server reroute a
# request after reading its body, rewrite the body with a corrected content-length, and
# strip credentials, and that Envoy's own 413 speaks Sluice's error shape.


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy 1.40 reads raw_value; a mutation that sets only `value` yields an empty header.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


class RerouteProcessor(ext_grpc.ExternalProcessorServicer):
    def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        for request in request_iterator:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                common = ext_pb.CommonResponse(
                    header_mutation=ext_pb.HeaderMutation(remove_headers=["authorization"])
                )
                yield ext_pb.ProcessingResponse(
                    request_headers=ext_pb.HeadersResponse(response=common)
                )
            elif phase == "request_body":
                body = request.request_body.body.replace(b"small", b"a-much-longer-model")
                common = ext_pb.CommonResponse(
                    header_mutation=ext_pb.HeaderMutation(
                        set_headers=[
                            _set(BACKEND_HEADER, "big"),
                            _set("content-length", str(len(body))),
                        ]
                    ),
                    body_mutation=ext_pb.BodyMutation(body=body),
                    clear_route_cache=True,
                )
                yield ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse(response=common))
            elif phase == "response_headers":
                yield ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())
            elif phase == "response_body":
                yield ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse())


def echo_backend(name: str) -> ThreadingHTTPServer:
    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server naming)
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            time.sleep(float(self.headers.get("x-echo-delay-ms", "0")) / 1000)
            out = json.dumps(
                {"backend": name, "headers": dict(self.headers), "body": body.decode()}
            ).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.e2e
def test_ext_proc_reroutes_and_rewrites_body(tmp_path: Path) -> None:
    opts = local_opts(max_body_bytes=64 * 1024)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ext_grpc.add_ExternalProcessorServicer_to_server(RerouteProcessor(), grpc_server)
    grpc_server.add_insecure_port(f"127.0.0.1:{opts.extproc_port}")
    grpc_server.start()
    small, big = echo_backend("small"), echo_backend("big")
    backends = [
        BackendRoute("small", "127.0.0.1", small.server_address[1]),
        BackendRoute("big", "127.0.0.1", big.server_address[1]),
    ]
    try:
        with running_envoy(tmp_path, backends, opts):
            status, _, body = post(
                opts.listen_port,
                b'{"model":"small"}',
                {
                    "content-type": "application/json",
                    "authorization": "Bearer sk-test",
                    BACKEND_HEADER: "small",  # a client's own pick is stripped
                },
            )
            assert status == 200, body
            echoed = json.loads(body)
            assert echoed["backend"] == "big"  # route re-evaluated after the body phase
            assert echoed["body"] == '{"model":"a-much-longer-model"}'
            upstream = {k.lower(): v for k, v in echoed["headers"].items()}
            assert upstream["content-length"] == str(len(echoed["body"]))
            assert "authorization" not in upstream
            assert BACKEND_HEADER not in upstream

            # Chunked, so no content-length sends it to the drain: Envoy's own buffer 413.
            too_big = b"x" * (buffer_limit_bytes(opts.max_body_bytes) + 1)
            status, headers, body = post(opts.listen_port, too_big, {}, chunked=True)
            assert status == 413
            assert headers["x-sluice-reason"] == "body_too_large"
            error = json.loads(body)["error"]
            assert set(error) == ERROR_KEYS and error["param"] is None
            assert error["type"] == "invalid_request_error"
    finally:
        grpc_server.stop(grace=None)
        small.shutdown()
        big.shutdown()


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
        "path_config_source": {"path": f"{tmp_path}/eds/pool.eds.yaml", "watched_directory": {"path": f"{tmp_path}/eds"}}}
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
        for route in vhost["routes"][1:]:  # after the drain route
            if route["route"]["cluster"] == "pool":
                assert route["route"]["retry_policy"] == {
                    "retry_on": "connect-failure", "num_retries": 1,
                    "retry_back_off": {"base_interval": "0.003s", "max_interval": "0.003s"}}
            else:
                assert "retry_policy" not in route["route"]
            # who served comes as the upstream.address attribute: no header for clients to see
            assert "response_headers_to_add" not in route
        assert "retry_policy" not in vhost["routes"][0]["route"]  # the drain
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


# A pool through the real Envoy, with a stub ext_proc server that names the endpoints the
# client asks for (x-test-endpoints) and copies the upstream.address attribute (who served,
# as extproc reads it) into x-test-served.


def _header(headers: base_pb2.HeaderMap, name: str) -> str | None:
    for h in headers.headers:
        if h.key == name:
            return h.raw_value.decode() if h.raw_value else h.value
    return None


class PickProcessor(ext_grpc.ExternalProcessorServicer):
    def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        for request in request_iterator:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                got = request.request_headers.headers
                sets = [_set(ENDPOINT_HEADER, _header(got, "x-test-endpoints") or "")]
                if _header(got, "x-test-max-retries") is not None:
                    sets.append(_set("x-envoy-max-retries", _header(got, "x-test-max-retries") or ""))
                common = ext_pb.CommonResponse(header_mutation=ext_pb.HeaderMutation(set_headers=sets))
                yield ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse(response=common))
            elif phase == "request_body":
                yield ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse())
            elif phase == "response_headers":
                served = msg.attribute(request, UPSTREAM_ATTRIBUTE) or "none"
                common = ext_pb.CommonResponse(header_mutation=ext_pb.HeaderMutation(
                    set_headers=[_set("x-test-served", str(served))]))
                yield ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse(response=common))
            elif phase == "response_body":
                yield ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse())
            elif phase == "response_trailers":
                yield ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse())


def envoy_stats(port: int) -> dict[str, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/stats")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {k: int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if v.isdigit()}


@pytest.mark.e2e
def test_a_refused_connection_is_retried_once_on_the_next_listed_endpoint(tmp_path: Path) -> None:
    opts = local_opts(eds_dir=str(tmp_path / "eds"))
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ext_grpc.add_ExternalProcessorServicer_to_server(PickProcessor(), grpc_server)
    grpc_server.add_insecure_port(f"127.0.0.1:{opts.extproc_port}")
    grpc_server.start()
    a, b = echo_backend("a"), echo_backend("b")
    live_a, live_b = (f"127.0.0.1:{s.server_address[1]}" for s in (a, b))
    closed = f"127.0.0.1:{free_port()}"  # in the endpoint set, nothing listens
    eds = Path(opts.eds_dir)
    eds.mkdir()
    write_if_changed(eds / "pool.eds.yaml", render_eds("pool", [closed, live_a]))

    def ask(endpoints: str, **extra: str) -> tuple[int, dict[str, str], bytes]:
        return post(opts.listen_port, b'{"model":"m"}', {"x-test-endpoints": endpoints, **extra})

    try:
        with running_envoy(tmp_path, [BackendRoute("pool", "127.0.0.1", 1, pool=True)], opts):
            status, headers, body = ask(f"{live_a},{closed}")
            assert status == 200 and json.loads(body)["backend"] == "a"
            assert headers["x-test-served"] == live_a

            # The first choice refuses: served by the second, and ext_proc saw where.
            for _ in range(3):
                status, headers, body = ask(f"{closed},{live_a}")
                assert status == 200, body
                assert json.loads(body)["backend"] == "a" and headers["x-test-served"] == live_a
            # Many at once, each served for 0.3 s: every one re-picked (a retry counts as in
            # flight until it is answered; Envoy's default allows 3 per cluster).
            with futures.ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda _: ask(f"{closed},{live_a}", **{"x-echo-delay-ms": "300"}), range(16)))
            assert [status for status, _, _ in got] == [200] * 16
            stats = envoy_stats(opts.admin_port)
            assert stats["cluster.pool.upstream_rq_retry_overflow"] == 0
            assert stats["cluster.pool.upstream_rq_retry"] >= 19
            assert stats["cluster.pool.upstream_cx_connect_fail"] >= 3

            # x-envoy-max-retries: 0 from ext_proc is honoured: no second attempt.
            status, headers, _ = ask(f"{closed},{live_a}", **{"x-test-max-retries": "0"})
            assert status == 503 and headers["x-test-served"] in ("none", closed)
            rejected = {k: v for k, v in envoy_stats(opts.admin_port).items() if "rejected_header_mutations" in k}
            assert rejected and set(rejected.values()) == {0}, rejected

            # A host not in the endpoint set is skipped (round robin over the set picks)...
            status, _, body = ask(live_b)
            assert status in (200, 503) and json.loads(body or b"{}").get("backend") != "b"
            # ... until the file names it: Envoy follows the file when it is replaced.
            write_if_changed(eds / "pool.eds.yaml", render_eds("pool", [closed, live_a, live_b]))
            def served_by_b() -> tuple[int, dict[str, str], bytes] | None:
                got = ask(live_b)
                return got if got[0] == 200 and json.loads(got[2])["backend"] == "b" else None

            status, headers, body = eventually(served_by_b, 10, "Envoy did not load the new endpoint set")
            assert headers["x-test-served"] == live_b
            # An empty set (no endpoint name resolves yet) is accepted: 503, Envoy stays up.
            write_if_changed(eds / "pool.eds.yaml", render_eds("pool", []))
            eventually(lambda: ask(live_a)[0] == 503, 10, "Envoy did not load the empty endpoint set")
            write_if_changed(eds / "pool.eds.yaml", render_eds("pool", [live_a]))
            eventually(lambda: ask(live_a)[0] == 200, 10, "Envoy did not come back from the empty set")
    finally:
        grpc_server.stop(grace=None)
        a.shutdown()
        b.shutdown()
