"""Revocation through the real Envoy: a premium request that cannot fit takes KV room back.

One engine (the simulated one, vLLM's priority scheduling) with room for one sequence at
a time, behind a Sluice whose KV budget is 2,048 tokens; premium keeps half of it while it
has demand, batch is revocable. Each test gets its own stack, so premium starts idle (its
guarantee lent) and a batch request can borrow it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.policy.schema import hash_key
from tests.e2e.billing import Billing
from tests.e2e.harness import Stack, get_json, running
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

KEYS = {"premium": "sk-rv-premium", "batch": "sk-rv-batch"}


def policy(port: int) -> dict[str, Any]:
    queue = {"max_queue_depth": 8, "max_queue_wait_ms": 10_000}
    return {
        "gateway": {"default_max_tokens": 128, "message_timeout_ms": 5000},
        "backends": [
            {
                "name": "sim",
                "address": f"127.0.0.1:{port}",
                "metrics_url": f"http://127.0.0.1:{port}/metrics",
                "max_concurrency": 8,
                "kv_capacity_tokens": 2048,
                "engine_priority": "vllm",
                "models": [
                    {"name": "sim-llama-8b", "context_window": 4096, "encoding": "cl100k_base"}
                ],
            }
        ],
        "tiers": {
            "premium": {"priority": 100, "tpm": 10**7, "rpm": 10**5, "kv_guaranteed": 0.5, **queue},
            "batch": {"priority": 0, "tpm": 10**7, "rpm": 10**5, "revocable": True, **queue},
        },
        "tenants": [{"name": f"t-{t}", "tier": t, "keys": [hash_key(k)]} for t, k in KEYS.items()],
    }


@pytest.fixture
def rv(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """A fresh stack per test (premium starts idle); the ledger checked as conftest's
    settled_and_balanced does for module stacks, before it stops."""
    s = Stack(tmp_path, sim_args=["--max-num-seqs", "1", "--scheduling-policy", "priority"])
    s.policy_doc = policy(s.sim_port)
    mode = request.node.get_closest_marker("response_processing")
    if mode is not None:  # the response side the test needs (the default: usage_trailers)
        s.policy_doc["gateway"]["response_processing"] = mode.args[0]
    with running(s) as started:
        # The budget is the whole cache once the engine's metrics are read (the watermark's
        # floor before).
        eventually(
            lambda: started.state()["backends"]["sim"]["scale"] == 1.0,
            15,
            lambda: str(started.state()["backends"]["sim"]),
        )
        yield started
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(s.logs())
            return
        st = s.wait_settled(5)
        ledger = st["ledger"]
        assert st["in_flight"] == 0 and ledger["outstanding"] == 0 and ledger["balanced"], ledger
        assert ledger["precharged"] + ledger["excess"] == ledger["charged"] + ledger["refunded"], (
            ledger
        )


def body(max_tokens: int, stream: bool) -> bytes:
    doc: dict[str, Any] = {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "hello " * 40}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        doc["stream_options"] = {"include_usage": True}
    return json.dumps(doc).encode()


def post(
    stack: Stack,
    tier: str,
    max_tokens: int,
    stream: bool,
    got: list[bytes] | None = None,
    **headers: str,
) -> tuple[int, dict[str, str], bytes]:
    """The answer; ``got`` collects a stream's chunks as they come."""
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=body(max_tokens, stream),
        method="POST",
        headers={
            "authorization": f"Bearer {KEYS[tier]}",
            "content-type": "application/json",
            **headers,
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = b""
            try:
                while chunk := r.read1(65536):
                    data += chunk
                    if got is not None:
                        got.append(chunk)
            # a revoked stream ends with a reset after its error event
            except Exception:  # noqa: BLE001
                pass
            return r.status, {k.lower(): v for k, v in r.headers.items()}, data
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


class Background:
    """A request sent in a thread, so the test can act while it runs."""

    def __init__(
        self, stack: Stack, tier: str, max_tokens: int, stream: bool, **headers: str
    ) -> None:
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self.chunks: list[bytes] = []  # a stream's chunks so far
        self._t = threading.Thread(
            target=self._go, args=(stack, tier, max_tokens, stream), kwargs=headers, daemon=True
        )
        self._t.start()

    def _go(self, stack: Stack, tier: str, max_tokens: int, stream: bool, **headers: str) -> None:
        self.result = post(stack, tier, max_tokens, stream, self.chunks, **headers)

    def join(self, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        self._t.join(timeout)
        assert self.result is not None, "the request did not finish"
        return self.result


def engine(stack: Stack) -> dict[str, Any]:
    return get_json(stack.sim_url + "/admin/engine")


def kv_state(stack: Stack) -> dict[str, Any]:
    return stack.state()["backends"]["sim"]["kv_shares"]


def test_a_premium_request_revokes_a_batch_request_queued_at_the_engine(rv: Stack) -> None:
    stack = rv
    before = stack.state()["ledger"]
    billing = Billing.of(stack)
    # A batch stream runs (the engine takes one sequence at a time) and a second batch
    # request, non-streaming, waits in the engine's queue: both hold Sluice's KV (750 + 750).
    running_doc = Background(stack, "batch", 700, True, **{"x-sim-tps": "10", "x-sim-tokens": "60"})
    eventually(lambda: engine(stack)["running"] == 1, 5, lambda: str(engine(stack)))
    queued = Background(stack, "batch", 700, False, **{"x-sim-tokens": "50"})
    eventually(lambda: engine(stack)["waiting"] == 1, 5, lambda: str(engine(stack)))
    aborted = engine(stack)["aborted"]

    # Premium (650 more: over the 2,048) is within its guarantee: the room comes back from the
    # request that has produced nothing, the one queued at the engine.
    t0 = time.monotonic()
    status, _, data = post(stack, "premium", 600, False, **{"x-sim-tokens": "5"})
    assert status == 200, data
    premium = json.loads(data)["usage"]
    assert premium["completion_tokens"] == 5
    assert time.monotonic() - t0 < 5  # not waiting for the running document to end

    status, headers, data = queued.join()
    assert status == 503 and headers["x-sluice-reason"] == "revoked"
    assert int(headers["retry-after"]) >= 1
    err = json.loads(data)["error"]
    assert err["code"] == "revoked" and err["type"] == "server_error"
    assert engine(stack)["aborted"] == aborted + 1  # the engine dropped it from its queue
    st = kv_state(stack)["revocation"]
    assert st["revoked"] == {"batch/unanswered": 1}
    assert [r["kind"] for r in st["recent"]] == ["unanswered"]

    status, _, data = running_doc.join()
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")  # the stream was left alone
    usage = [
        json.loads(e[6:])["usage"]
        for e in data.decode().split("\n\n")
        if e.startswith("data: {") and json.loads(e[6:]).get("usage")
    ][-1]

    # The revoked request was not billed: what was charged is the two that were served.
    after = stack.wait_settled()["ledger"]
    assert after["charged"] - before["charged"] == premium["total_tokens"] + usage["total_tokens"]
    # and against the engine's own record: the revoked one charged 0, aborted there
    pairs = billing.check(expect={"revoked": 1, "reported": 2})
    revoked = next(p for p in pairs if p.basis == "revoked")
    assert revoked.work is not None and revoked.work["finished_reason"] == "abort"


# The error event needs the response body read chunk by chunk: Envoy 1.40 ignores a per-request
# mode_override beside the one-round-trip request side, so that is response_processing: streamed.
@pytest.mark.response_processing("streamed")
def test_a_revocable_stream_ends_with_an_error_event_and_is_billed_what_it_produced(
    rv: Stack,
) -> None:
    stack = rv
    before = stack.state()["ledger"]
    billing = Billing.of(stack)
    doc = Background(stack, "batch", 1800, True, **{"x-sim-tps": "20", "x-sim-tokens": "1500"})
    eventually(
        lambda: (
            engine(stack)["running"] == 1
            and kv_state(stack)["tiers"]["batch"]["reserved_tokens"] > 0
        ),
        5,
        lambda: str(engine(stack)),
    )
    # let it stream some tokens (the engine paces it at 20/s)
    eventually(lambda: b"".join(doc.chunks).count(b"data: ") >= 5, 10, lambda: str(doc.chunks))
    status, _, data = post(stack, "premium", 600, False, **{"x-sim-tokens": "5"})
    assert status == 200, data
    premium = json.loads(data)["usage"]

    status, _, raw = doc.join()
    assert status == 200
    events = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events and "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "revoked" and "higher tier" in last["error"]["message"]
    streamed = sum(
        1
        for e in events[:-1]
        if json.loads(e).get("choices")
        and json.loads(e)["choices"][0].get("delta", {}).get("content")
    )
    assert streamed > 0
    eventually(
        lambda: engine(stack)["running"] == 0 and engine(stack)["aborted"] == 1,
        5,
        lambda: str(engine(stack)),
    )
    st = kv_state(stack)["revocation"]
    assert st["revoked"] == {"batch/streaming": 1} and st["decision_to_release_ms"]["n"] == 1
    # Billed what it produced: its prompt (the same as premium's) plus the tokens it streamed.
    after = stack.wait_settled()["ledger"]
    batch = after["charged"] - before["charged"] - premium["total_tokens"]
    assert abs(batch - (premium["prompt_tokens"] + streamed)) <= 1, (batch, premium, streamed)
    # and against the engine's record: counted from the stream, within what the engine did
    pairs = billing.check(expect={"counted": 1, "reported": 1})
    cut = next(p for p in pairs if p.basis == "counted")
    assert cut.work is not None and cut.work["finished_reason"] == "abort"


def test_under_usage_trailers_a_revoked_stream_is_cut_and_billed_within_its_bound(rv: Stack) -> None:
    """Without the body read chunk by chunk, the out-of-turn ImmediateResponse ends the stream
    (no error event: Envoy resets it), the engine aborts, and the bill is the estimate, held
    against the engine's own record."""
    stack = rv
    billing = Billing.of(stack)
    doc = Background(stack, "batch", 1800, True, **{"x-sim-tps": "20", "x-sim-tokens": "1500"})
    eventually(lambda: b"".join(doc.chunks).count(b"data: ") >= 5, 15, lambda: str(doc.chunks))
    status, _, data = post(stack, "premium", 600, False, **{"x-sim-tokens": "5"})
    assert status == 200, data
    try:
        _, _, raw = doc.join()
    except Exception:  # noqa: BLE001 - a reset stream may surface as a client error
        raw = b"".join(doc.chunks)
    assert b"[DONE]" not in raw
    eventually(lambda: engine(stack)["running"] == 0 and engine(stack)["aborted"] == 1, 5,
               lambda: str(engine(stack)))
    assert kv_state(stack)["revocation"]["revoked"] == {"batch/streaming": 1}
    stack.wait_settled()
    pairs = billing.check(expect={"estimated": 1, "reported": 1})
    cut = next(p for p in pairs if p.basis == "estimated")
    assert cut.work is not None and cut.work["finished_reason"] == "abort"


def test_the_engine_sees_each_tiers_priority(rv: Stack) -> None:
    stack = rv
    stack.clear_sim_requests()
    for tier in ("premium", "batch"):
        status, _, _ = post(stack, tier, 8, False, **{"x-sim-tokens": "2"})
        assert status == 200
    got = {
        r["headers"].get("x-sluice-tier"): r["json"].get("priority") for r in stack.sim_requests()
    }
    assert got == {"premium": -100, "batch": 0}
