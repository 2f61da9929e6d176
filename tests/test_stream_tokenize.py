"""The request-body phase's counting: refused prompts are paid for, a spent key is refused
before its body is read, a tokenizer failure is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from tests.test_stream import Clock, exchange, headers

WINDOW = 4096


def policy(tpm: int) -> Any:
    return build_policy({
        "gateway": {"max_body_bytes": 3 << 19},
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      "models": [{"name": "m", "context_window": WINDOW}]}],
        "tiers": {"t": {"tpm": tpm, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


def chat(content: str, **extra: Any) -> pb.ProcessingRequest:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))


HDR = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")


def reason_of(r: pb.ProcessingResponse) -> tuple[int, str, dict[str, Any]]:
    ir = r.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, hdrs["x-sluice-reason"], json.loads(ir.body)["error"]


@pytest.fixture
def rt() -> Any:
    clock = Clock()
    runtime = Runtime(policy(tpm=12_000), clock=clock)
    runtime.backends["b"].has_metrics = False
    yield runtime
    runtime.close()


def remaining(rt: Runtime) -> int:
    tv, _ = rt.state.view("a", rt.policy.limits(rt.policy.tenants["a"]), rt.clock())
    return tv.remaining


def test_junk_is_refused_charged_and_then_refused_before_it_is_tokenized(rt: Runtime) -> None:
    calls = []
    count_prompt = rt.count_prompt

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await count_prompt(*args, **kwargs)

    rt.count_prompt = counted  # type: ignore[method-assign]
    junk = " " * (1 << 20)  # 8,192 tokens: twice the window
    status, reason, err = reason_of(asyncio.run(exchange(rt, HDR, chat(junk)))[-1])
    assert (status, reason, err["code"]) == (400, "context_length", "context_length_exceeded")
    assert f"more than {WINDOW} tokens" in err["message"]
    # The count stopped past the window, and that much was charged as spent.
    spent = 12_000 - remaining(rt)
    assert WINDOW < spent < WINDOW + 200
    status, reason, _ = reason_of(asyncio.run(exchange(rt, HDR, chat(junk)))[-1])
    assert (status, reason) == (400, "context_length")
    assert remaining(rt) <= 12_000 - 2 * WINDOW
    # Three more and the key is in debt: refused with 429 before anything is tokenized.
    for _ in range(2):
        asyncio.run(exchange(rt, HDR, chat(junk)))
    n = len(calls)
    answers = asyncio.run(exchange(rt, HDR, chat(junk)))
    assert len(answers) == 1, "refused at the request headers: the body is never sent to extproc"
    out = answers[-1]
    status, reason, err = reason_of(out)
    assert (status, reason) == (429, "tpm")
    assert "budget is spent" in err["message"]
    hdrs = {h.header.key: h.header.raw_value.decode() for h in out.immediate_response.headers.set_headers}
    assert int(hdrs["retry-after"]) >= 1 and hdrs["x-ratelimit-remaining-tokens"] == "0"
    assert len(calls) == n, "the body was tokenized although the key could not pay"
    m = rt.metrics.render().decode()
    assert 'sluice_tokens_charged_refused_total{reason="context_length",tenant="a"}' in m
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["balanced"] and st["ledger"]["outstanding"] == 0


def test_a_tokenizer_failure_is_a_400_naming_it_and_is_charged(rt: Runtime) -> None:
    counter = rt.encodings["cl100k_base"]

    def panic(text: str) -> int:  # like pyo3's PanicException: a BaseException, not an Exception
        raise BaseException("called `Result::unwrap()` on an `Err` value: RuntimeError(StackOverflow)")

    counter._count = panic
    out = asyncio.run(exchange(rt, HDR, chat("x" * 40_000, max_tokens=10)))[-1]
    status, reason, err = reason_of(out)
    assert (status, reason, err["code"], err["param"]) == (400, "tokenizer_failed", "tokenizer_failed", "messages")
    assert "StackOverflow" in err["message"] and err["type"] == "invalid_request_error"
    assert 12_000 - remaining(rt) == WINDOW + 1  # 1 token per 4 characters, capped past the window
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]


def test_a_prompt_that_fits_is_charged_exactly_as_before(rt: Runtime) -> None:
    out = asyncio.run(exchange(rt, HDR, chat("hello " * 3000, max_tokens=10)))
    assert not out[-1].HasField("immediate_response")
    # Forwarded: the prompt (exact count + chat overhead) + max_tokens was pre-charged.
    prompt = rt.encodings["cl100k_base"].count(["user", "hello " * 3000]).tokens + 3 + 3
    assert rt.metrics.registry.get_sample_value("sluice_tokens_precharged_total", {"tenant": "a"}) == prompt + 10


def test_a_key_with_max_concurrency_prompts_waiting_to_be_counted_gets_429(rt: Runtime) -> None:
    cap = rt.policy.limits(rt.policy.tenants["a"]).max_concurrency
    for _ in range(cap):  # counts of this key already waiting in the fair scheduler
        rt.token_pool.queue.push("a", object())  # type: ignore[arg-type]
    status, reason, err = reason_of(asyncio.run(exchange(rt, HDR, chat("word " * 5000)))[-1])
    assert (status, reason) == (429, "slots") and f"limit {cap}" in err["message"]
    assert remaining(rt) == 12_000  # refused before counting: nothing charged
    rt.token_pool.queue.clear()  # the stand-ins are not real waiters
