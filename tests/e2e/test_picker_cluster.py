"""The pool's endpoints from the cluster, end to end: GIE's reference Envoy in front of Sluice
``--picker --inference-pool``, whose Kubernetes client watches the Kubernetes API's list and
watch served over HTTP (tests/kube_api.py). Each "pod" is a simulated engine on its own
loopback address (127.0.0.2, .3, .4) and the pool's one target port, as pods in a cluster
share a port on different IPs. What could not be run here: a real API server, kubelet
readiness, EndpointSlices, or the gateway's controller turning the InferencePool into its
config (the config is the vendored one)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from extproc.wire.health import SERVING, HealthCheckRequest, HealthCheckResponse
from tests.e2e.harness import TEST_KEYS, Proc, eventually, free_port, running, wait_http
from tests.e2e.picker_stack import ENGINE_ARGS, MODEL, PickerStack, picker_policy, render_vendored
from tests.kube_api import KubeApi, fixture, pod

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
PREMIUM = {"authorization": f"Bearer {TEST_KEYS['premium']}"}
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
APP = {"app": "vllm"}


class ClusterStack(PickerStack):
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.api = KubeApi()
        super().__init__(workdir, render_vendored("gie"),
                         ("--inference-pool", "pool=default/sluice-pool", "--kubeconfig",
                          str(self.api.kubeconfig(workdir / "kubeconfig"))))
        # The template the pods' endpoints take their budgets and metrics path from.
        self.policy_doc = picker_policy([self.port])
        self.label = "cluster"

    def engine_url(self, i: int) -> str:
        return f"http://{HOSTS[i]}:{self.port}"

    def start_sim(self) -> None:
        for i, host in enumerate(HOSTS):
            p = Proc(f"sim-{i}", [sys.executable, "-m", "bench.simbackend", "--host", host, "--port", str(self.port),
                                  *ENGINE_ARGS], self.workdir / f"sim-{i}.log")
            self.procs[f"sim-{i}"] = p.start()
            wait_http(f"{self.engine_url(i)}/health", proc=p.popen)

    def stop(self) -> None:
        super().stop()
        self.api.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    s = ClusterStack(tmp_path_factory.mktemp("picker-cluster"))
    ip = fixture("inferencepool.json")
    ip["spec"]["targetPorts"] = [{"number": s.port}]  # the engines' one port
    s.api.put("inferencepools", ip)
    s.api.put("pods", pod("vllm-0", HOSTS[0], APP))
    s.api.put("pods", pod("vllm-1", HOSTS[1], APP))
    s.api.put("pods", pod("vllm-2", HOSTS[2], APP, ready=False))
    s.api.put("inferenceobjectives", fixture("inferenceobjective.json"))
    with running(s):
        yield s


def pool(s: ClusterStack) -> list[str]:
    return sorted(e["address"] for e in s.state()["backends"]["pool"]["endpoints"] if not e["draining"])


def served(s: ClusterStack) -> dict[int, int]:
    out = {}
    for i in range(len(HOSTS)):
        reqs = [r for r in s.engine_requests(i) if r["path"] == CHAT]
        for r in reqs:
            assert r["headers"]["x-gateway-destination-endpoint"] == f"{HOSTS[i]}:{s.port}"
        out[i] = len(reqs)
    return out


def send(s: ClusterStack, n: int, headers: dict[str, str] | None = None) -> list[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with ThreadPoolExecutor(10) as ex:
        return list(ex.map(lambda _: httpx.post(s.url + CHAT, headers={**PREMIUM, **(headers or {})}, json=body,
                                                timeout=30).status_code, range(n)))


def test_ready_once_the_pool_is_listed_and_requests_go_to_ready_pods(stack: ClusterStack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.health_port}") as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=HealthCheckRequest.SerializeToString,
                               response_deserializer=HealthCheckResponse.FromString)
        assert check(HealthCheckRequest(service="readiness"), timeout=5).status == SERVING
    assert pool(stack) == [f"{HOSTS[0]}:{stack.port}", f"{HOSTS[1]}:{stack.port}"]
    before = served(stack)
    assert send(stack, 30) == [200] * 30
    after = served(stack)
    assert after[2] == before[2]  # the pod that is not ready got nothing
    assert after[0] + after[1] - before[0] - before[1] == 30


def test_the_pool_follows_readiness(stack: ClusterStack) -> None:
    stack.api.put("pods", pod("vllm-2", HOSTS[2], APP, ready=True))
    stack.api.put("pods", pod("vllm-0", HOSTS[0], APP, ready=False))
    want = [f"{HOSTS[1]}:{stack.port}", f"{HOSTS[2]}:{stack.port}"]
    eventually(lambda: pool(stack) == want, 10, f"the pool to be {want}")
    before = served(stack)
    assert send(stack, 30) == [200] * 30
    after = served(stack)
    assert after[0] == before[0]
    assert after[1] + after[2] - before[1] - before[2] == 30


def test_a_sheddable_objective_is_admitted_in_the_lowest_tier(stack: ClusterStack) -> None:
    def bulk_ttft_count() -> float:
        for line in stack.metrics_text().splitlines():
            if line.startswith("sluice_ttft_seconds_count{") and 'tier="tiny"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = bulk_ttft_count()
    assert send(stack, 3, {"x-gateway-inference-objective": "batch-summaries"}) == [200] * 3
    assert bulk_ttft_count() == before + 3
    assert send(stack, 2) == [200] * 2
    assert bulk_ttft_count() == before + 3  # without the header: the tenant's own tier
