"""The official ``openai`` SDK as the client, through the real Envoy, extproc and simulated backend.

What SDKs, LangChain and Open WebUI do first (list models), the chat calls with and
without streamed usage, the Responses API, and how a refusal surfaces in the SDK.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from extproc.policy.schema import hash_key
from tests.e2e import harness
from tests.e2e.harness import TEST_KEYS, Stack, running

pytestmark = pytest.mark.e2e
MODEL = "sim-llama-8b"
# One tenant per test where budgets are read, so no test sees another's spending.
# The "slow" tier refills 10 tokens/s: a refund of ~100 tokens stands out from refill.
KEYS = {"refund": "sk-sdk-refund", "resp": "sk-sdk-resp", "broke": "sk-sdk-broke"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("sdk"))
    doc = harness.test_policy(s.sim_port)
    doc["tiers"]["slow"] = {"priority": 5, "tpm": 600, "rpm": 100_000, "max_concurrency": 64}
    doc["tiers"]["broke"] = {"priority": 5, "tpm": 120, "rpm": 100_000, "max_concurrency": 64}
    doc["tenants"] += [
        {"name": "t-sdk-refund", "tier": "slow", "keys": [hash_key(KEYS["refund"])]},
        {"name": "t-sdk-resp", "tier": "premium", "keys": [hash_key(KEYS["resp"])]},
        {"name": "t-sdk-broke", "tier": "broke", "keys": [hash_key(KEYS["broke"])]},
    ]
    s.policy_doc = doc
    with running(s):
        yield s


def client(stack: Stack, key: str = TEST_KEYS["premium"], **kw: Any) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key=key, **kw)


def charged(stack: Stack) -> int:
    return int(stack.wait_settled()["ledger"]["charged"])


# -- models ----------------------------------------------------------------------

def test_models_list_and_retrieve_come_from_the_policy(stack: Stack) -> None:
    stack.clear_sim_requests()
    c = client(stack)
    models = c.models.list()
    assert [m.id for m in models.data] == ["sim-llama-8b", "sim-o200k"]
    assert all(m.object == "model" and m.owned_by == "sluice" and m.created > 0 for m in models.data)
    assert list(models) == models.data  # the SDK's page iterates (no next page)
    one = c.models.retrieve("sim-o200k")
    assert (one.id, one.object) == ("sim-o200k", "model")
    with pytest.raises(openai.NotFoundError) as ei:
        c.models.retrieve("gpt-4o")
    assert ei.value.code == "model_not_found" and ei.value.param == "model"
    assert ei.value.response.headers["x-sluice-reason"] == "unknown_model"
    raw = c.models.with_raw_response.list()
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
    # Answered by Sluice: the backend never saw a models request.
    assert not [r for r in stack.sim_requests() if r["path"].startswith("/v1/models")]


def test_models_need_a_valid_key(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as ei:
        client(stack, key="sk-nobody").models.list()
    assert ei.value.status_code == 401 and ei.value.code == "invalid_api_key"
    assert not any(k.startswith("x-ratelimit") for k in ei.value.response.headers)
    r = httpx.get(f"{stack.url}/v1/models", timeout=10)  # no key at all
    assert r.status_code == 401 and r.headers["x-sluice-reason"] == "unknown_key"


# -- chat ------------------------------------------------------------------------

def test_chat_non_streaming(stack: Stack) -> None:
    c = client(stack)
    before = charged(stack)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=20,
        extra_headers={"x-sim-tokens": "6"})
    done = raw.parse()
    assert done.choices[0].message.content and done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens == 6
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert charged(stack) - before == done.usage.total_tokens


STREAM_ARGS: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five"}],
                               "max_tokens": 100, "stream": True, "extra_headers": {"x-sim-tokens": "5"}}


def stream_chat(c: AsyncOpenAI, **kw: Any) -> tuple[int, list[Any]]:
    """(remaining tokens right after admission, the chunks the SDK yields).

    The async client: it reads an HTTP/1.1 stream to its end after ``[DONE]``. The sync
    client (openai 3.57) closes the response on ``[DONE]``, which can beat Envoy to the
    response's end, where the usage reaches Sluice with the trailers: then Sluice settles
    a disconnect by estimate (see the test after this one). Exact refunds need the end."""
    async def go() -> tuple[int, list[Any]]:
        raw = await c.chat.completions.with_raw_response.create(**STREAM_ARGS, **kw)
        chunks = [ch async for ch in raw.parse()]
        await c.close()
        return int(raw.headers["x-ratelimit-remaining-tokens"]), chunks
    return asyncio.run(go())


def async_client(stack: Stack, key: str) -> AsyncOpenAI:
    # A new client per call: each asyncio.run has its own event loop.
    return AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key)


def test_streaming_usage_only_when_asked_and_the_refund_shows_in_the_next_request(stack: Stack) -> None:
    def c() -> AsyncOpenAI:
        return async_client(stack, KEYS["refund"])
    # Asked: the last chunk is the usage chunk, with no choices.
    r1, asked = stream_chat(c(), stream_options={"include_usage": True})
    usage = asked[-1].usage
    assert usage is not None and asked[-1].choices == [] and usage.completion_tokens == 5
    assert "".join(ch.choices[0].delta.content or "" for ch in asked[:-1] if ch.choices)
    t1 = time.monotonic()
    stack.wait_settled()
    # Not asked: Sluice asked the backend for usage on its own behalf and removed that chunk.
    r2, plain = stream_chat(c())
    t2 = time.monotonic()
    assert plain and all(ch.usage is None and ch.choices for ch in plain), plain[-1]
    assert sum(len(ch.choices[0].delta.content or "") > 0 for ch in plain) == 5
    assert stack.sim_requests()[-1]["json"]["stream_options"] == {"include_usage": True}
    # Both reserved prompt + 100; the first used prompt + 5 and got the rest back, so the
    # second's pre-charge leaves the bucket only that usage lower (plus the refill meanwhile).
    # Without the refund it would be ~95 tokens lower.
    refill = 10 * (t2 - t1) + 2
    assert -usage.total_tokens <= r2 - r1 <= -usage.total_tokens + refill, (r1, r2, usage)
    stack.wait_settled()
    r3, _ = stream_chat(c())
    t3 = time.monotonic()
    # The second (no usage chunk for the client) was refunded from the backend's usage just the same.
    assert -usage.total_tokens <= r3 - r2 <= -usage.total_tokens + 10 * (t3 - t2) + 2, (r2, r3)


def settles(stack: Stack) -> dict[str, float]:
    return {how: float(v) for how, v in
            re.findall(r'^sluice_settles_total\{how="([a-z_]+)"\} (\S+)$', stack.metrics_text(), re.M)}


def test_the_sync_client_hangs_up_on_done_and_each_stream_still_settles_once_within_its_reservation(
        stack: Stack) -> None:
    """The sync SDK closes the response as soon as it reads ``[DONE]``. When that beats the
    response's end, the usage never reaches Sluice (it rides on the trailers there), and the
    stream settles as a disconnect: charged the prompt plus the decode-rate estimate, never
    more than the reservation and never less than the prompt; and always exactly once."""
    c = client(stack, key=TEST_KEYS["premium"])
    prompt_tokens = 10  # "Count to five" as the sim counts it (asserted below from the usage)
    n = 8
    before, settled_before = stack.wait_settled()["ledger"], settles(stack)
    used = 0
    for _ in range(n):
        chunks = list(c.chat.completions.create(**STREAM_ARGS, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == prompt_tokens and usage.completion_tokens == 5
        used += usage.total_tokens
    after, settled_after = stack.wait_settled()["ledger"], settles(stack)
    by_how = {how: settled_after.get(how, 0.0) - settled_before.get(how, 0.0) for how in settled_after}
    assert sum(by_how.values()) == n, by_how  # each stream settled once
    estimated = by_how.get("disconnect", 0.0)
    assert set(by_how) <= {"end_of_stream", "disconnect"} and by_how.get("end_of_stream", 0.0) + estimated == n
    charged = after["charged"] - before["charged"]
    exact = used * (n - estimated) / n
    # Each estimated stream is charged between its prompt and its reservation (prompt + 100).
    assert exact + estimated * prompt_tokens <= charged <= exact + estimated * (prompt_tokens + 100), \
        (charged, used, by_how)
    assert after["balanced"] and after["outstanding"] == 0
    print(f"sync SDK: {n} streams, settled {by_how}, charged {charged} for {used} used")


# -- the Responses API ----------------------------------------------------------------

def test_responses_non_streaming_is_charged_from_its_usage(stack: Stack) -> None:
    c = client(stack, key=KEYS["resp"])
    stack.clear_sim_requests()
    before = charged(stack)
    resp = c.responses.create(model=MODEL, input="Write a haiku", instructions="Be brief.",
                              max_output_tokens=40, extra_headers={"x-sim-tokens": "9"})
    assert resp.status == "completed" and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens == 9
    assert charged(stack) - before == resp.usage.total_tokens
    sent = stack.sim_requests()[-1]["json"]
    assert sent["max_output_tokens"] == 40 and "stream_options" not in sent and "max_tokens" not in sent
    # No max_output_tokens: the policy default is reserved and written in, as for chat.
    before = charged(stack)
    resp = c.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}],
                              extra_headers={"x-sim-tokens": "3"})
    assert stack.sim_requests()[-1]["json"]["max_output_tokens"] == 128
    assert resp.usage is not None and charged(stack) - before == resp.usage.total_tokens


def test_responses_streaming_is_charged_from_the_completed_event(stack: Stack) -> None:
    c = client(stack, key=KEYS["resp"])
    before = charged(stack)
    events = list(c.responses.create(model=MODEL, input="Tell me more", stream=True, max_output_tokens=30,
                                      extra_headers={"x-sim-tokens": "6"}))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types.count("response.output_text.delta") == 6
    assert [e.sequence_number for e in events] == list(range(len(events)))  # nothing removed
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens == 6
    assert charged(stack) - before == final.usage.total_tokens
    assert "stream_options" not in stack.sim_requests()[-1]["json"]
    # The SDK's own stream helper accumulates the events into the final response.
    before = charged(stack)
    with c.responses.stream(model=MODEL, input="Again", extra_headers={"x-sim-tokens": "4"}) as s:
        got = s.get_final_response()
    assert got.output_text == " the of and to"  # the simulated model's first four words, accumulated
    assert got.usage is not None and got.usage.output_tokens == 4
    assert charged(stack) - before == got.usage.total_tokens


# -- refusals as the SDK sees them --------------------------------------------------------

def test_a_429_is_a_rate_limit_error_with_the_openai_body(stack: Stack) -> None:
    c = client(stack, key=KEYS["broke"], max_retries=0)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100,
                              extra_headers={"x-sim-tokens": "100"})
    with pytest.raises(openai.RateLimitError) as ei:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    err = ei.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert isinstance(err.body, dict) and set(err.body) == {"message", "type", "param", "code"}
    assert "limit" in err.body["message"].lower() or "token" in err.body["message"].lower()
    h = err.response.headers
    assert h["x-sluice-reason"] == "tpm" and h["x-ratelimit-limit-tokens"] == "120"
    assert int(h["retry-after"]) >= 1 and int(h["retry-after"]) == -(-int(h["retry-after-ms"]) // 1000)
    # Fifty refusals in a burst do not all name the same moment to come back.
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        delays = []
        for _ in range(50):
            r = http.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['broke']}"},
                          json={"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 429, r.text
            delays.append(int(r.headers["retry-after-ms"]))
    assert len(set(delays)) > 25, delays
    assert max(delays) - min(delays) <= 0.25 * min(delays) + 1500, delays


def test_refused_bodies_never_reach_the_backend_and_carry_the_tenants_numbers(stack: Stack) -> None:
    stack.clear_sim_requests()
    c = client(stack, max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  stream_options={"include_usage": True})
    assert ei.value.param == "stream_options"
    h = ei.value.response.headers
    assert h["x-sluice-reason"] == "bad_request" and h["x-ratelimit-limit-tokens"] == "1000000"
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                   headers={"authorization": f"Bearer {TEST_KEYS['premium']}", "content-type": "application/json"},
                   content=b'{"model":"sim-llama-8b","max_tokens":9000,"max_tokens":4,'
                           b'"messages":[{"role":"user","content":"hi"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.headers["x-sluice-reason"] == "bad_request" and "x-ratelimit-remaining-tokens" in r.headers
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert nf.value.code == "model_not_found" and "x-ratelimit-remaining-requests" in nf.value.response.headers
    assert stack.sim_requests() == []
