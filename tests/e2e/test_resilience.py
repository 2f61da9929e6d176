"""The gateway under operational churn: policy hot reload and extproc restarts."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.policy.model import Gateway
from tests.e2e.harness import TEST_KEYS, Stack, running
from tests.e2e.harness import test_policy as base_policy
from tests.waiting import eventually

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(Stack(tmp_path_factory.mktemp("resilience"))) as s:
        yield s


def ask(stack: Stack, key: str = "free", **extra: object) -> httpx.Response:
    body = {"model": "sim-llama-8b", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(stack.url + CHAT, json=body, timeout=20,
                      headers={"authorization": f"Bearer {TEST_KEYS[key]}", "x-sim-tokens": "3"})


def test_hot_reload_swaps_limits_and_keeps_last_good_on_error(stack: Stack) -> None:
    assert ask(stack).headers["x-ratelimit-limit-tokens"] == "200000"
    doc = base_policy(stack.sim_port)
    doc["tiers"]["free"]["tpm"] = 123_456
    stack.write_policy(doc)
    eventually(lambda: ask(stack).headers["x-ratelimit-limit-tokens"] == "123456", 3,
               "the new limit did not take effect", interval=0.1)
    # A broken edit: the last good policy stays, and says so in a metric.
    (stack.policy_dir / "policy.yaml").write_text("tiers: [this is: not valid")
    eventually(lambda: "sluice_policy_valid 0.0" in stack.metrics_text(), 5, "the broken edit was not read")
    r = ask(stack)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "123456"
    metrics = stack.metrics_text()
    assert "sluice_policy_valid 0.0" in metrics
    assert 'sluice_policy_reloads_total{result="invalid"}' in metrics
    assert "not valid YAML" in stack.procs["extproc"].tail(200)
    stack.write_policy()
    eventually(lambda: "sluice_policy_valid 1.0" in stack.metrics_text(), 3, "the good policy was not read back",
               interval=0.1)


def test_extproc_restart_fails_closed_then_recovers(stack: Stack) -> None:
    assert ask(stack).status_code == 200
    stack.procs["extproc"].stop()
    r = ask(stack)
    # Fail closed: no ext_proc, no admission. The body says why, in the OpenAI shape.
    assert r.status_code == 503, r.text
    assert r.headers.get("x-sluice-reason") == "gateway_unavailable"
    assert r.json()["error"]["message"]
    stack.start_extproc()
    eventually(lambda: ask(stack).status_code == 200, 5, "traffic did not recover after the restart", interval=0.1)
    assert stack.wait_settled()["in_flight"] == 0


def test_extproc_killed_mid_stream_ends_the_stream_or_lets_it_finish(stack: Stack) -> None:
    body = {"model": "sim-llama-8b", "max_tokens": 300, "stream": True,
            "messages": [{"role": "user", "content": "tell me"}]}
    headers = {"authorization": f"Bearer {TEST_KEYS['premium']}", "x-sim-tokens": "300", "x-sim-tps": "30"}
    logged = stack.policy_doc is not None and \
        stack.policy_doc["gateway"].get("response_processing", Gateway().response_processing) == "access_log"
    with httpx.stream("POST", stack.url + CHAT, json=body, headers=headers, timeout=20) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        next(chunks)
        stack.procs["extproc"].stop()
        if logged:
            # access_log: the ext_proc stream ended once the request was answered, so the
            # response no longer depends on extproc; it streams to its end.
            assert b"data: [DONE]" in b"".join(chunks)
        else:
            with pytest.raises(httpx.HTTPError):  # the stream is cut, not left hanging
                for _ in chunks:
                    pass
    stack.start_extproc()
    eventually(lambda: ask(stack).status_code == 200, 5, "traffic did not recover after the restart", interval=0.1)
