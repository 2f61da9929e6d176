"""Sluice as the picker of an Istio-shaped gateway, and what each failure mode does without it.

Istio's pool (``override_host``, ``tests.e2e.gateway_configs.istio``) is the one that reads the
metadata only, honours an ordered list and reports who served: with
``--picker-fallback-list`` Sluice names its pick and a second choice; when the pick refuses
the connection, Envoy retries on the second, says so in ``metadata_context``, and Sluice
moves the request's hold there (as its own data path's re-pick does).

GIE's conformance ``EppUnAvailableFailOpen`` reproduced, with the picker process gone: a
FailOpen Istio pool still answers (round robin); a FailOpen ORIGINAL_DST pool (GIE's config
with ``failure_mode_allow: true``) has no endpoint without the picker's header and answers
503; a FailClose pool (AI Gateway's ``failure_mode_allow: false``) answers 500.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.envoy import eds
from extproc.envoy.eds import write_if_changed
from tests.e2e import gateway_configs as gc
from tests.e2e.harness import TEST_KEYS, eventually, free_port, running
from tests.e2e.picker_stack import MODEL, PickerStack, render_aigw, render_istio

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
PREMIUM = {"authorization": f"Bearer {TEST_KEYS['premium']}"}


def chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class IstioWithDeadPick(PickerStack):
    """A fourth pool member that refuses connections, with the most KV room and no metrics, so
    Sluice picks it first; Istio's pool lists it too."""

    def __init__(self, workdir: Any) -> None:
        super().__init__(workdir, render_istio(), ("--picker-fallback-list",))
        self.dead_port = free_port()  # nothing listens here
        assert self.policy_doc is not None
        self.policy_doc["backends"][0]["endpoints"].append(
            {"address": f"127.0.0.1:{self.dead_port}", "kv_capacity_tokens": 64 * 512 * 16})

    @property
    def engines(self) -> list[tuple[str, int]]:
        return [*super().engines, ("127.0.0.1", self.dead_port)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    s = IstioWithDeadPick(tmp_path_factory.mktemp("picker-istio"))
    with running(s):
        yield s


def repicks(s: PickerStack) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in s.metrics_text().splitlines():
        if line.startswith("sluice_endpoint_repicks_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_served_elsewhere_moves_the_hold(stack: PickerStack) -> None:
    dead = f"127.0.0.1:{stack.dead_port}"  # type: ignore[attr-defined]
    r = httpx.post(stack.url + CHAT, headers=PREMIUM, json=chat(), timeout=30)
    assert r.status_code == 200
    moved = repicks(stack)
    assert len(moved) == 1, moved
    (labels, count), = moved.items()
    assert count == 1 and f'from_endpoint="{dead}"' in labels, moved
    served = [i for i in range(len(stack.engine_ports)) if any(q["path"] == CHAT for q in stack.engine_requests(i))]
    assert len(served) == 1
    assert f'to_endpoint="127.0.0.1:{stack.engine_ports[served[0]]}"' in labels
    # The request was named "dead,second": the engine that served had it as the second choice.
    req = next(q for q in stack.engine_requests(served[0]) if q["path"] == CHAT)
    assert req["headers"]["x-gateway-destination-endpoint"] == f"{dead},127.0.0.1:{stack.engine_ports[served[0]]}"
    pool = {e["address"]: e for e in stack.wait_settled()["backends"]["pool"]["endpoints"]}
    assert pool[dead]["repicks"]["away"] == 1


# -- the picker gone --------------------------------------------------------------------
class GoneStack(PickerStack):
    """The gateway reaches the picker through an endpoints file, as through a Service."""

    @property
    def picker_eds(self) -> Path:
        return self.workdir / "picker-eds" / "ext_proc.eds.yaml"

    def set_picker_endpoints(self, listed: bool) -> None:
        self.picker_eds.parent.mkdir(exist_ok=True)
        write_if_changed(self.picker_eds, eds.render("ext_proc", [f"127.0.0.1:{self.picker_port}"] if listed else []))


GONE: dict[str, tuple[Callable[[PickerStack], dict[str, Any]], int, int]] = {
    # gateway: (its config, the answer once the picker's endpoint is gone, while it is still listed)
    "istio-failopen": (render_istio(fail_open=True), 200, 500),
    "gie-failopen": (lambda s: gc.fail_open(gc.relocate(gc.vendored("gie"), s.ports)), 503, 500),
    "aigw-failclose": (render_aigw(), 500, 500),
}


@pytest.fixture(scope="module", params=sorted(GONE))
def gone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GoneStack, str]]:
    render = GONE[request.param][0]
    s = GoneStack(tmp_path_factory.mktemp(f"gone-{request.param}"),
                  lambda st: gc.picker_by_eds(render(st), st.picker_eds))  # type: ignore[attr-defined]
    s.set_picker_endpoints(True)
    with running(s):
        yield s, request.param


def answered_by_sluice(s: PickerStack) -> bool:
    r = httpx.post(s.url + CHAT, headers=PREMIUM, json=chat(), timeout=30)
    return r.status_code == 200 and "x-ratelimit-limit-tokens" in r.headers


def test_picker_pod_gone(gone: tuple[GoneStack, str]) -> None:
    """Conformance's EppUnAvailableFailOpen, as a picker pod dies: first the process is gone while
    the gateway still lists it, then the Service drops it.

    While listed, under FULL_DUPLEX the request body has often gone out to the picker when the
    connection fails, and Envoy then fails the request whatever the failure mode (500). Once the
    endpoint is gone the failure mode decides: FailOpen passes the request on (Istio's pool
    falls back to round robin: 200; an ORIGINAL_DST pool has no header to go by: 503),
    FailClose answers 500. A health-checked picker cluster (GIE's) keeps a host it still
    checks healthy after the Service drops it, so that takes its health checks' time."""
    s, name = gone
    assert answered_by_sluice(s)
    s.procs["extproc"].stop()  # returns once the process has exited
    r = httpx.post(s.url + CHAT, headers=PREMIUM, json=chat(), timeout=30)
    # Which comes first, the body going out or the connection failing, is a race (seen both
    # ways for a FailOpen pool); either way Sluice did not answer.
    assert r.status_code in (GONE[name][2], GONE[name][1]), r.text
    assert "x-ratelimit-limit-tokens" not in r.headers
    s.set_picker_endpoints(False)
    want = GONE[name][1]
    eventually(lambda: httpx.post(s.url + CHAT, headers=PREMIUM, json=chat(), timeout=30).status_code == want,
               45, f"{name}: {want} once the picker's endpoint is gone")
