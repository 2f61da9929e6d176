"""The simulated backend's OpenAI surface over HTTP: chat, completions, embeddings, the Responses API,
its usage, errors, admin and metric names."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest

from bench.simbackend.openai_fmt import WORDS, generated_text
from tests.sim_client import (
    CHAT,
    aio,
    chat,
    chat_prompt_tokens,
    encodings_fixture,  # noqa: F401 - the encodings fixture
    engine_of,
    sim,
    sse_events,
)


# ---- generated text ---------------------------------------------------------------------
def test_generated_text_counts_the_same_in_both_encodings(encodings: tuple[Any, Any]) -> None:
    for enc in encodings:
        assert all(len(enc.encode_ordinary(w)) == 1 for w in WORDS)
        for choice in range(3):
            for n in (0, 1, 7, len(WORDS) + 5, 333):
                assert len(enc.encode_ordinary(generated_text(choice, n))) == n


# ---- OpenAI API -------------------------------------------------------------------------
@aio
async def test_chat_non_streaming_shape_and_usage(encodings: tuple[Any, Any]) -> None:
    cl, o200 = encodings
    async with sim() as c:
        r = await c.post(CHAT, json=chat("say something nice"), headers={"x-sim-tokens": "17"})
        assert r.status == 200
        body = await r.json()
        assert body["object"] == "chat.completion" and body["model"] == "llama-test"
        assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
        text = choice["message"]["content"]
        prompt = chat_prompt_tokens(cl, "say something nice")
        assert body["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": 17,
            "total_tokens": prompt + 17,
        }
        assert len(cl.encode_ordinary(text)) == len(o200.encode_ordinary(text)) == 17

        # max_tokens caps the programmed length; then it is "length".
        r = await c.post(CHAT, json=chat(max_tokens=5), headers={"x-sim-tokens": "17"})
        body = await r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
        # max_completion_tokens wins over max_tokens; n choices each generate.
        r = await c.post(CHAT, json=chat(max_completion_tokens=4, max_tokens=9, n=3))
        body = await r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 12
        assert len({ch["message"]["content"] for ch in body["choices"]}) == 3


@aio
async def test_chat_prompt_counts_text_parts(encodings: tuple[Any, Any]) -> None:
    cl, _ = encodings
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look at"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "this picture"},
            ],
        },
    ]
    async with sim() as c:
        r = await c.post(CHAT, json={"messages": msgs}, headers={"x-sim-tokens": "1"})
        body = await r.json()
    expected = (
        sum(len(cl.encode_ordinary(t)) for t in ("system", "be brief", "user", "look at", "this picture"))
        + 3 * 2
        + 3
    )
    assert body["usage"]["prompt_tokens"] == expected
    assert body["model"] == "sim-llama-8b"  # no model in the request: the served name


@aio
async def test_completions_and_embeddings(encodings: tuple[Any, Any]) -> None:
    cl, _ = encodings
    async with sim() as c:
        r = await c.post("/v1/completions", json={"prompt": "once upon a time", "max_tokens": 6})
        body = await r.json()
        assert (
            body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
        )
        assert len(cl.encode_ordinary(body["choices"][0]["text"])) == 6
        assert body["usage"]["prompt_tokens"] == len(cl.encode_ordinary("once upon a time"))
        r = await c.post(
            "/v1/completions", json={"prompt": [1, 2, 3, 4, 5]}, headers={"x-sim-tokens": "2"}
        )
        body = await r.json()
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}

        r = await c.post("/v1/embeddings", json={"model": "emb", "input": ["hello world", "bye"]})
        body = await r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        assert all(len(d["embedding"]) == 8 and d["object"] == "embedding" for d in body["data"])
        n = len(cl.encode_ordinary("hello world")) + len(cl.encode_ordinary("bye"))
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        r = await c.post(
            "/v1/embeddings", json={"input": [[1, 2, 3]]}, headers={"x-sim-usage": "none"}
        )
        body = await r.json()
        assert "usage" not in body and len(body["data"]) == 1

        r = await c.get("/v1/models")
        assert (await r.json())["data"][0]["id"] == "sim-llama-8b"


@aio
async def test_streaming_without_include_usage(encodings: tuple[Any, Any]) -> None:
    cl, o200 = encodings
    async with sim() as c:
        r = await c.post(CHAT, json=chat(stream=True), headers={"x-sim-tokens": "9"})
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in ch for ch in chunks)
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [ch["choices"][0]["delta"]["content"] for ch in chunks[1:]]
    assert len(content) == 9  # one event per token
    text = "".join(content)
    assert len(cl.encode_ordinary(text)) == len(o200.encode_ordinary(text)) == 9
    reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}


@aio
async def test_streaming_with_include_usage(encodings: tuple[Any, Any]) -> None:
    cl, _ = encodings
    payload = chat("count me", stream=True, stream_options={"include_usage": True}, max_tokens=4)
    async with sim() as c:
        r = await c.post(CHAT, json=payload)
        events = sse_events(await r.text())
        r = await c.post(
            "/v1/completions",
            json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
            headers={"x-sim-tokens": "3"},
        )
        cevents = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *body, last = chunks
    assert all("usage" in ch and ch["usage"] is None for ch in body)
    assert last["choices"] == []
    prompt = chat_prompt_tokens(cl, "count me")
    assert last["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
    }
    assert body[-1]["choices"][0]["finish_reason"] == "length"
    cchunks = [json.loads(e) for e in cevents[:-1]]
    assert [ch["choices"][0]["text"] for ch in cchunks[:-1]] == list(WORDS[:3])
    assert cchunks[-1]["usage"]["completion_tokens"] == 3 and cchunks[-1]["choices"] == []


@aio
async def test_sim_usage_none_hides_usage_everywhere() -> None:
    async with sim() as c:
        h = {"x-sim-usage": "none", "x-sim-tokens": "3"}
        body = await (await c.post(CHAT, json=chat(), headers=h)).json()
        assert "usage" not in body and body["choices"][0]["message"]["content"]
        r = await c.post(
            CHAT, json=chat(stream=True, stream_options={"include_usage": True}), headers=h
        )
        events = sse_events(await r.text())
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4 and all("usage" not in ch for ch in chunks)


@aio
async def test_sim_status_and_errors() -> None:
    async with sim() as c:
        r = await c.post(CHAT, json=chat(), headers={"x-sim-status": "503"})
        assert r.status == 503
        err = (await r.json())["error"]
        assert set(err) == {"message", "type", "code", "param"} and err["type"] == "server_error"
        assert engine_of(c).prompt_tokens_total == 0  # never reached the engine

        r = await c.post(CHAT, data=b"{not json", headers={"content-type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await c.post(CHAT, json={"messages": "nope"})
        assert r.status == 400
        r = await c.post(CHAT, json=chat(max_tokens=0))
        assert r.status == 400

    async with sim(max_model_len=64) as c:
        r = await c.post(CHAT, json=chat("word " * 30, max_tokens=40))
        assert r.status == 400
        err = (await r.json())["error"]
        assert (
            err["code"] == "context_length_exceeded"
            and "maximum context length is 64" in err["message"]
        )
        r = await c.post(CHAT, json=chat("word " * 80))
        assert r.status == 400


@aio
async def test_fail_after_aborts_the_stream_mid_way() -> None:
    async with sim() as c:
        r = await c.post(
            CHAT, json=chat(stream=True), headers={"x-sim-tokens": "50", "x-sim-fail-after": "3"}
        )
        assert r.status == 200
        got: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async for line in r.content:
                got.append(line)
        events = [json.loads(ln[6:]) for ln in got if ln.startswith(b"data: {")]
        assert sum(1 for ev in events if ev["choices"][0]["delta"].get("content")) == 3
        assert b"data: [DONE]\n" not in got
        await asyncio.sleep(0.05)
        assert engine_of(c).used_blocks == 0

        # Non-streaming: the connection drops without any response.
        with pytest.raises(aiohttp.ClientError):
            await c.post(CHAT, json=chat(), headers={"x-sim-tokens": "50", "x-sim-fail-after": "2"})


@aio
async def test_admin_requests_recording_and_config() -> None:
    async with sim() as c:
        await c.post(
            CHAT,
            json=chat(max_tokens=2),
            headers={"x-sluice-tenant": "acme", "Authorization": "Bearer k"},
        )
        await c.get("/metrics")
        await c.get("/health")
        recs = await (await c.get("/admin/requests")).json()
        assert len(recs) == 1  # probes and admin calls are not recorded
        rec = recs[0]
        assert rec["method"] == "POST" and rec["path"] == CHAT
        assert (
            rec["headers"]["x-sluice-tenant"] == "acme"
            and rec["headers"]["authorization"] == "Bearer k"
        )
        assert rec["json"]["max_tokens"] == 2 and rec["body_len"] > 0 and rec["time"] > 0
        await c.post(CHAT, data=b"garbage")
        recs = await (await c.get("/admin/requests", params={"path": CHAT})).json()
        assert recs[-1]["json"] is None and recs[-1]["body_len"] == 7
        assert (await c.delete("/admin/requests")).status == 200
        assert await (await c.get("/admin/requests")).json() == []

        r = await c.post("/admin/config", json={"fail_status": 502, "kv_usage_override": 0.9})
        assert (await r.json())["fail_status"] == 502
        assert (await c.post(CHAT, json=chat())).status == 502
        metrics = await (await c.get("/metrics")).text()
        assert 'vllm:kv_cache_usage_perc{model_name="sim-llama-8b"} 0.9' in metrics
        await c.post("/admin/config", json={"fail_status": None, "kv_usage_override": None})
        assert (await c.post(CHAT, json=chat(max_tokens=1))).status == 200
        assert (await c.post("/admin/config", json={"fail_status": 200})).status == 400
        assert (await c.post("/admin/config", json={"bogus": 1})).status == 400
        cfg = await (await c.get("/admin/config")).json()
        assert cfg == {
            "kv_usage_override": None,
            "fail_status": None,
            "mode": "preempt",
            "time_scale": 20.0,
        }


METRIC_NAMES = {
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "sim:oom_failures_total",
}


@aio
async def test_metrics_names() -> None:
    async with sim() as c:
        await c.post(CHAT, json=chat(max_tokens=3))
        r = await c.get("/metrics")
        text = await r.text()
    samples = {}
    for line in text.splitlines():
        m = re.match(r'^([a-z_:]+)\{model_name="sim-llama-8b"\} (\S+)$', line)
        if m:
            samples[m[1]] = float(m[2])
    assert set(samples) >= METRIC_NAMES, METRIC_NAMES - set(samples)
    assert not any(name.endswith("_created") for name in samples)
    assert samples["vllm:generation_tokens_total"] == 3
    assert samples["vllm:kv_cache_usage_perc"] == 0.0


# ---- the Responses API ------------------------------------------------------------------
def sse_typed(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of a Responses API stream: each event names its type twice."""
    assert raw.endswith("\n\n"), raw[-80:]
    out = []
    for block in raw.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        out.append((data["type"], data))
    return out


@aio
async def test_responses_non_streaming_shape_and_usage(encodings: tuple[Any, Any]) -> None:
    cl, _ = encodings
    async with sim() as c:
        payload = {"model": "llama-test", "input": "tell me", "instructions": "be brief"}
        r = await c.post("/v1/responses", json=payload, headers={"x-sim-tokens": "6"})
        assert r.status == 200
        body = await r.json()
        r = await c.post("/v1/responses", json={**payload, "max_output_tokens": 2},
                         headers={"x-sim-tokens": "6"})
        short = await r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["instructions"] == "be brief"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    text = item["content"][0]["text"]
    assert item["content"][0]["type"] == "output_text" and len(cl.encode_ordinary(text)) == 6
    # instructions count as a system message, the input as a user message.
    prompt = chat_prompt_tokens(cl, "tell me") + 3 + len(cl.encode_ordinary("system")) + 2
    assert body["usage"]["input_tokens"] == prompt
    assert body["usage"]["output_tokens"] == 6
    assert body["usage"]["total_tokens"] == prompt + 6
    # max_output_tokens cuts it: "incomplete", as OpenAI reports a length stop.
    assert short["status"] == "incomplete" and short["usage"]["output_tokens"] == 2
    assert short["incomplete_details"] == {"reason": "max_output_tokens"}


@aio
async def test_responses_streaming_events_and_final_usage(encodings: tuple[Any, Any]) -> None:
    cl, _ = encodings
    payload = {"model": "llama-test", "stream": True,
               "input": [{"role": "user", "content": [{"type": "input_text", "text": "count me"}]}]}
    async with sim() as c:
        r = await c.post("/v1/responses", json=payload, headers={"x-sim-tokens": "4"})
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_typed(await r.text())
        r = await c.post("/v1/responses", json=payload, headers={"x-sim-tokens": "2", "x-sim-usage": "none"})
        hidden = sse_typed(await r.text())
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[4:8] == ["response.output_text.delta"] * 4
    assert names[8:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for name, d in events if name.endswith(".delta"))
    assert deltas == events[8][1]["text"]
    # Usage only in the last event; the first carries the response with none yet.
    assert events[0][1]["response"]["usage"] is None
    final = events[-1][1]["response"]
    assert final["usage"]["input_tokens"] == chat_prompt_tokens(cl, "count me")
    assert final["usage"]["output_tokens"] == 4
    assert final["output"][0]["content"][0]["text"] == deltas
    assert hidden[-1][1]["response"]["usage"] is None


@aio
async def test_responses_rejects_what_vllm_rejects() -> None:
    async with sim() as c:
        r = await c.post("/v1/responses", json={"model": "llama-test"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "input"
        r = await c.post("/v1/responses", json={"input": "x", "max_output_tokens": 0})
        assert r.status == 400 and (await r.json())["error"]["param"] == "max_output_tokens"
        r = await c.post("/v1/responses", json={"input": "x", "max_output_tokens": 10**7})
        assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"


