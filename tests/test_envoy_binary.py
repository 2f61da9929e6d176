"""The rendered Envoy config in the real binary, with stub ext_proc servers and echoing
backends: it validates, fails closed, turns a message timeout into Sluice's 503, lets
ext_proc reroute and rewrite a body, and retries a refused connection on the next
endpoint of a pool."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from bench.procs import envoy_binary, free_port
from extproc.envoy.bootstrap import (
    BACKEND_HEADER,
    BackendRoute,
    EnvoyOptions,
    write_config,
)
from extproc.envoy.eds import render as render_eds
from extproc.envoy.eds import write_if_changed
from extproc.envoy.headers import ENDPOINT_HEADER, UPSTREAM_ATTRIBUTE
from extproc.wire import messages as msg
from tests.envoy_config import BACKENDS, ERROR_KEYS
from tests.waiting import eventually


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


def post(port: int, body: bytes, headers: dict[str, str], chunked: bool = False,
         chunks: list[bytes] | None = None) -> tuple[int, dict[str, str], bytes]:
    # A key of the right shape, or Envoy answers 401 itself before ext_proc (extproc.envoy.edge).
    headers = {"authorization": "Bearer sk-test-envoyconfig", **headers}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        if chunked:
            conn.request("POST", "/v1/chat/completions", body=iter(chunks or [body]), headers=headers,
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
# strip credentials, all in its deferred answer to the request headers.


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy 1.40 reads raw_value; a mutation that sets only `value` yields an empty header.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


class RerouteProcessor(ext_grpc.ExternalProcessorServicer):
    """Sluice's side of the request in one round trip: the headers' answer waits for the
    complete body, then carries the routing, the credentials' removal and the new
    content-length; then one answer per body chunk, the first with the new body."""

    def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        chunks: list[bytes] = []
        for request in request_iterator:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                assert request.protocol_config.send_body_without_waiting_for_header_response
                continue  # answered with the body
            if phase == "request_body":
                chunks.append(request.request_body.body)
                if not request.request_body.end_of_stream:
                    continue
                body = b"".join(chunks).replace(b"small", b"a-much-longer-model")
                common = ext_pb.CommonResponse(
                    header_mutation=ext_pb.HeaderMutation(
                        set_headers=[_set(BACKEND_HEADER, "big"), _set("content-length", str(len(body)))],
                        remove_headers=["authorization"],
                    ),
                    clear_route_cache=True,
                )
                yield ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse(response=common))
                yield ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse(
                    response=ext_pb.CommonResponse(body_mutation=ext_pb.BodyMutation(body=body))))
                for _ in chunks[1:]:
                    yield ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse(
                        response=ext_pb.CommonResponse(body_mutation=ext_pb.BodyMutation(clear_body=True))))
                chunks = []
            elif phase == "response_headers":
                yield ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())
            elif phase == "response_body":
                yield ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse())
            elif phase == "response_trailers":
                yield ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse())


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

            # A chunked upload of several chunks: the answers replace them with one body.
            status, _, body = post(opts.listen_port, b'{"model":"small"}', {}, chunked=True,
                                   chunks=[b'{"mo', b'del":"sm', b'all"}'])
            assert status == 200, body
            echoed = json.loads(body)
            assert echoed["backend"] == "big" and echoed["body"] == '{"model":"a-much-longer-model"}'
            upstream = {k.lower(): v for k, v in echoed["headers"].items()}
            assert upstream["content-length"] == str(len(echoed["body"]))
    finally:
        grpc_server.stop(grace=None)
        small.shutdown()
        big.shutdown()


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
                # The response side is off in the filter's static mode: the route turns it on
                # (usage_trailers; Envoy 1.40 ignores a mode_override with the one-round-trip
                # request side, so none is sent).
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
