"""What a picker serves besides ext_proc: TLS that gateways accept unverified, gRPC health with the
Inference Extension's service names on both ports, Prometheus metrics on their own port."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import grpc
import httpx
import pytest

from extproc.wire.health import NOT_SERVING, SERVING, HealthCheckRequest, HealthCheckResponse
from tests.e2e.harness import TEST_KEYS, eventually, running
from tests.e2e.picker_stack import MODEL, PickerStack, render_vendored

pytestmark = pytest.mark.e2e
SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    s = PickerStack(tmp_path_factory.mktemp("picker-serving"), render_vendored("gie"))
    with running(s):
        yield s


def check(channel: grpc.Channel, service: str) -> int:
    call = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=HealthCheckRequest.SerializeToString,
                               response_deserializer=HealthCheckResponse.FromString)
    return call(HealthCheckRequest(service=service), timeout=5).status


def test_health_port_is_plaintext_with_the_picker_services(picker: PickerStack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{picker.health_port}") as ch:
        assert [check(ch, s) for s in SERVICES] == [SERVING] * 3
        with pytest.raises(grpc.RpcError) as err:
            check(ch, "no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_ext_proc_port_is_tls_with_a_generated_certificate(picker: PickerStack) -> None:
    pem = ssl.get_server_certificate(("127.0.0.1", picker.picker_port))
    assert "BEGIN CERTIFICATE" in pem
    creds = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    with grpc.secure_channel(f"127.0.0.1:{picker.picker_port}", creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        assert [check(ch, s) for s in SERVICES] == [SERVING] * 3
    with grpc.insecure_channel(f"127.0.0.1:{picker.picker_port}") as ch, pytest.raises(grpc.RpcError):
        check(ch, "liveness")  # plaintext is refused on the TLS port


def test_gateway_health_checks_pass_over_tls(picker: PickerStack) -> None:
    """GIE's config checks the picker with grpc_health_check service ExternalProcessor, over TLS
    with an empty validation context."""
    eventually(lambda: picker.envoy_stat("cluster.ext_proc.health_check.success") >= 1, 15,
               "a passing health check of the picker")
    assert picker.envoy_stat("cluster.ext_proc.health_check.failure") == 0


def test_metrics_port(picker: PickerStack) -> None:
    r = httpx.post(picker.url + "/v1/chat/completions", headers={"authorization": f"Bearer {TEST_KEYS['premium']}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=20)
    assert r.status_code == 200
    text = httpx.get(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5).text
    assert 'sluice_requests_total{outcome="admitted",tenant="t-premium"} 1.0' in text, text[:2000]


def test_not_serving_while_draining(picker: PickerStack) -> None:
    """Last in this module: SIGTERM turns readiness and the ext_proc service NOT_SERVING (liveness
    stays SERVING) while the gateway's checks see it."""
    p = picker.procs["extproc"]
    assert p.popen is not None
    with grpc.insecure_channel(f"127.0.0.1:{picker.health_port}") as ch:
        # Checking before the signal makes this channel a live checker, which the drain waits
        # for (as it waits for a gateway's): else a loaded host may see the process gone first.
        assert check(ch, "readiness") == SERVING
        p.popen.send_signal(15)
        eventually(lambda: check(ch, "readiness") == NOT_SERVING, 5, "readiness NOT_SERVING on SIGTERM")
        assert check(ch, "envoy.service.ext_proc.v3.ExternalProcessor") == NOT_SERVING
        assert check(ch, "liveness") == SERVING
