"""The simulated vLLM backend: engine model (fake clock) and HTTP behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bench.simbackend import STATE, BackgroundServer, SimConfig, create_app
from bench.simbackend.app import load_encoding
from bench.simbackend.engine import Engine, Sequence
from bench.simbackend.openai_fmt import WORDS, generated_text

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test with plain pytest (pytest-asyncio is not guaranteed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


@contextlib.asynccontextmanager
async def sim(**cfg: Any) -> AsyncIterator[TestClient]:
    cfg.setdefault("time_scale", 20.0)
    async with TestClient(TestServer(create_app(SimConfig(**cfg)))) as client:
        yield client


def engine_of(client: TestClient) -> Engine:
    return client.server.app[STATE].engine


def chat(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "llama-test", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-80:]
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


@pytest.fixture(scope="module")
def encodings() -> tuple[Any, Any]:
    return load_encoding("cl100k_base"), load_encoding("o200k_base")


def chat_prompt_tokens(enc: Any, *texts: str) -> int:
    """OpenAI's accounting for user messages: role and content tokens, 3 per message, 3 priming."""
    return sum(len(enc.encode_ordinary(t)) + len(enc.encode_ordinary("user")) for t in texts) + 3 * len(texts) + 3


# ---- engine, driven by a fake clock ----------------------------------------------------
def drive(engine: Engine, max_steps: int = 200_000) -> tuple[float, float]:
    """Step until nothing is left to do; returns (model time, peak kv usage)."""
    now, peak = 0.0, 0.0
    for _ in range(max_steps):
        out = engine.step(now)
        peak = max(peak, engine.kv_usage)
        if out.duration > 0:
            now += out.duration
        elif out.wake_at is not None:
            now = out.wake_at
        else:
            return now, peak
    raise AssertionError("engine did not settle")


def test_engine_ample_blocks_never_preempts() -> None:
    e = Engine(SimConfig(kv_blocks=1000, block_size=16))
    seqs = [Sequence(prompt_tokens=300, max_tokens=60) for _ in range(20)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    assert e.preemptions_total == 0
    assert all(s.state == "finished" and s.generated == 60 for s in seqs)
    assert e.free_blocks == e.total_blocks
    assert e.prompt_tokens_total == 20 * 300
    assert e.generation_tokens_total == 20 * 60


def test_engine_runs_out_of_kv_and_preempts() -> None:
    # 64 blocks x 16 = 1024 tokens for 8 sequences that each grow to 400.
    e = Engine(SimConfig(kv_blocks=64, block_size=16))
    seqs = [Sequence(prompt_tokens=200, max_tokens=200, natural_stop=True) for _ in range(8)]
    for s in seqs:
        e.add(s, 0.0)
    _, peak = drive(e)
    assert e.preemptions_total > 0
    assert peak >= 0.95
    # Recompute keeps what was generated: every request still completes in full.
    assert all(s.state == "finished" and s.generated == 200 for s in seqs)
    assert all(s.finish_reason == "stop" for s in seqs)
    assert e.free_blocks == e.total_blocks and not e.running and not e.waiting


def test_engine_preempts_newest_to_front_of_queue() -> None:
    e = Engine(SimConfig(kv_blocks=4, block_size=4, watermark=0.0))
    a, b, c = (Sequence(prompt_tokens=4, max_tokens=10) for _ in range(3))
    for s in (a, b, c):
        e.add(s, 0.0)
    out = e.step(0.0)  # prefill: a and b take 2 blocks each (prompt + first token)
    assert out.kind == "prefill" and e.running == [a, b] and list(e.waiting) == [c]
    now = out.duration
    while not e.preemptions_total:
        now += e.step(now).duration
    # a is older: when it needs a third block, b (newest) is evicted and queued ahead of c.
    assert b.state == "waiting" and list(e.waiting) == [b, c] and b.blocks == 0
    assert a.blocks == 3 and e.free_blocks == 1
    made = b.generated
    drive(e)
    assert b.state == "finished" and b.generated == 10 and b.num_preemptions >= 1 and made > 0


def test_engine_oom_mode_fails_all_running_and_pauses() -> None:
    e = Engine(SimConfig(kv_blocks=16, block_size=16, mode="oom", oom_pause_s=2.0, watermark=0))
    seqs = [Sequence(prompt_tokens=100, max_tokens=200) for _ in range(3)]
    for s in seqs:
        e.add(s, 0.0)
    now, failed = 0.0, []
    while not failed:
        out = e.step(now)
        failed = out.failed
        now += out.duration
    assert {s.state for s in failed} == {"failed"} and failed[0].error[0] == 500
    assert e.oom_failures_total == len(failed) >= 2
    assert e.free_blocks == e.total_blocks and not e.running
    assert e.paused(now)
    late = Sequence(prompt_tokens=10, max_tokens=1)
    e.add(late, now)
    out = e.step(now)
    assert out.kind == "idle" and late.state == "waiting" and out.wake_at == e.paused_until
    e.step(e.paused_until)
    assert late.state in ("running", "finished")


def test_engine_abort_frees_blocks() -> None:
    e = Engine(SimConfig(kv_blocks=100, block_size=16))
    s, w = Sequence(prompt_tokens=500, max_tokens=100), Sequence(prompt_tokens=10, max_tokens=5)
    e.add(s, 0.0)
    e.step(0.0)
    e.add(w, 0.0)
    assert e.used_blocks == 32
    e.abort(s)
    e.abort(w)
    assert e.used_blocks == 0 and not e.running and not e.waiting
    assert s.state == w.state == "aborted"


def test_engine_delay_and_own_pace() -> None:
    e = Engine(SimConfig(kv_blocks=100))
    s = Sequence(prompt_tokens=50, max_tokens=30, delay=1.0, tps=10.0)
    e.add(s, 0.0)
    out = e.step(0.0)
    assert out.kind == "prefill" and s.state == "running" and s.generated == 0
    assert s.blocks > 0  # a delayed request still holds its KV
    out = e.step(out.duration)
    assert out.kind == "idle" and out.wake_at == pytest.approx(1.0)
    out = e.step(1.0)
    assert s.generated == 1
    first = s.first_token_at
    assert first is not None
    # Own pace: about 10 tokens per second after the first, whatever the step rate.
    e.step(first + 1.0 + 1e-6)
    assert s.generated == 11


def test_engine_rejects_prompt_larger_than_cache() -> None:
    e = Engine(SimConfig(kv_blocks=10, block_size=16))
    s = Sequence(prompt_tokens=1000, max_tokens=5)
    e.add(s, 0.0)
    out = e.step(0.0)
    assert out.failed == [s] and s.error is not None and s.error[0] == 400
    assert e.free_blocks == 10


def test_default_pacing_gives_64_chats_30_to_50_tokens_per_second() -> None:
    e = Engine(SimConfig())
    seqs = [Sequence(prompt_tokens=100, max_tokens=400) for _ in range(64)]
    for s in seqs:
        e.add(s, 0.0)
    now = e.step(0.0).duration
    start, gen0 = now, seqs[0].generated
    for _ in range(200):
        now += e.step(now).duration
    rate = (seqs[0].generated - gen0) / (now - start)
    assert 30 <= rate <= 50, rate


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


# ---- the KV model through HTTP ---------------------------------------------------------
async def _many(c: TestClient, count: int, words: int, tokens: int, **headers: str) -> list[int]:
    async def one() -> int:
        r = await c.post(
            CHAT, json=chat("alpha " * words), headers={"x-sim-tokens": str(tokens), **headers}
        )
        await r.read()
        return r.status

    return await asyncio.gather(*(one() for _ in range(count)))


@aio
async def test_overload_preempts_and_fills_the_cache() -> None:
    async with sim(kv_blocks=64, block_size=16, time_scale=50.0) as c:
        statuses = await _many(c, 10, 200, 150)
        e = engine_of(c)
        assert statuses == [200] * 10
        assert e.preemptions_total > 0 and e.peak_used_blocks >= 0.95 * e.total_blocks
        assert e.used_blocks == 0
        text = await (await c.get("/metrics")).text()
    assert re.search(r"^vllm:num_preemptions_total\{[^}]*\} [1-9]", text, re.M)


@aio
async def test_ample_cache_no_preemption() -> None:
    async with sim(kv_blocks=2048, time_scale=50.0) as c:
        assert await _many(c, 10, 200, 150) == [200] * 10
        assert engine_of(c).preemptions_total == 0


@aio
async def test_oom_mode_fails_requests_with_500() -> None:
    async with sim(
        kv_blocks=64, block_size=16, mode="oom", time_scale=50.0, oom_pause_s=100.0
    ) as c:
        e = engine_of(c)
        load = asyncio.ensure_future(_many(c, 8, 200, 150))
        while not e.oom_failures_total:
            await asyncio.sleep(0.005)
        # Paused, as if restarting after the crash: health says so.
        assert (await c.get("/health")).status == 503
        text = await (await c.get("/metrics")).text()
        assert re.search(r"^sim:oom_failures_total\{[^}]*\} [1-9]", text, re.M)
        # Time scale is live: the 100 s pause now passes in milliseconds.
        await c.post("/admin/config", json={"time_scale": 10000.0})
        statuses = await load
        assert 500 in statuses and statuses.count(500) == e.oom_failures_total
        for _ in range(100):
            if (await c.get("/health")).status == 200:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("still paused")
        # The mode is live too: preempt mode serves the same load completely.
        await c.post("/admin/config", json={"mode": "preempt", "time_scale": 50.0})
        assert await _many(c, 8, 200, 150) == [200] * 8


@contextlib.asynccontextmanager
async def served(cancellation: bool, **cfg: Any) -> AsyncIterator[tuple[str, Engine]]:
    """A real runner; handler_cancellation=False is what a plain web.run_app does."""
    app = create_app(SimConfig(**cfg))
    runner = web.AppRunner(app, handler_cancellation=cancellation, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[STATE].engine
    finally:
        await runner.cleanup()


async def _until_freed(e: Engine) -> None:
    for _ in range(100):
        if e.used_blocks == 0 and not e.running and not e.waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {e.used_blocks}")


@pytest.mark.parametrize("cancellation", [True, False])
@aio
async def test_disconnect_frees_blocks(cancellation: bool) -> None:
    async with served(cancellation) as (url, e), aiohttp.ClientSession() as s:
        r = await s.post(
            url + CHAT,
            json=chat("x " * 500, stream=True),
            headers={"x-sim-tps": "20", "x-sim-tokens": "1000"},
        )
        await r.content.readline()  # headers and the first event arrived: it is running
        assert e.used_blocks > 0 and len(e.running) == 1
        r.close()
        await _until_freed(e)

        # Non-streaming, still waiting for its (delayed) first token.
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                url + CHAT,
                json=chat(),
                headers={"x-sim-delay-ms": "5000"},
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
        await _until_freed(e)


@aio
async def test_delay_header_delays_first_token() -> None:
    async with sim(time_scale=1.0) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await c.post(CHAT, json=chat(max_tokens=1), headers={"x-sim-delay-ms": "300"})
        assert r.status == 200
        assert loop.time() - t0 >= 0.3


# ---- starting it ------------------------------------------------------------------------
def test_background_server() -> None:
    with BackgroundServer(SimConfig(time_scale=50.0)) as srv:
        req = urllib.request.Request(
            srv.url + CHAT,
            data=json.dumps(chat(max_tokens=2)).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 2
        assert srv.call(lambda: srv.state.engine.generation_tokens_total) == 2


def test_cli_prints_listening_line() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.simbackend",
            "--port",
            "0",
            "--kv-blocks",
            "128",
            "--mode",
            "oom",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"simbackend listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(m[1] + "/admin/engine", timeout=5) as resp:
            state = json.load(resp)
        assert state["kv_blocks_total"] == 128 and state["mode"] == "oom"
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


# ---- chunked prefill (vLLM V1 scheduling) ----------------------------------------------
def test_chunked_prefill_admits_long_prompts_by_their_first_chunk_and_thrashes() -> None:
    # 256 blocks x 16 = 4096 tokens; three 1,800-token prompts generating 200 each. Whole
    # prompts, only two fit at once; chunk by chunk all three are admitted, and they
    # outgrow the cache: the newest is preempted (recompute) again and again.
    cfg = SimConfig(kv_blocks=256, block_size=16, chunked_prefill=True, max_num_batched_tokens=128)
    e = Engine(cfg)
    seqs = [Sequence(prompt_tokens=1800, max_tokens=200) for _ in range(3)]
    for s in seqs:
        e.add(s, 0.0)
    out = e.step(0.0)  # the first chunk of the first prompt takes the whole budget
    assert out.kind == "prefill" and e.running == [seqs[0]] and seqs[0].prefill_left == 1672
    assert seqs[0].blocks == 8 and not out.emitted
    assert out.duration == pytest.approx((cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 0.128) / 1000)
    now, peak = drive(e)
    assert e.preemptions_total >= 2 and peak >= 0.95
    assert all(s.state == "finished" and s.generated == 200 for s in seqs)
    assert e.free_blocks == e.total_blocks and not e.running and not e.waiting
    assert e.prompt_tokens_total == 3 * 1800


def test_chunked_prefill_mixes_decode_with_prompt_chunks() -> None:
    cfg = SimConfig(kv_blocks=1000, block_size=16, chunked_prefill=True, max_num_batched_tokens=256)
    e = Engine(cfg)
    chat = Sequence(prompt_tokens=100, max_tokens=50)
    e.add(chat, 0.0)
    out = e.step(0.0)
    assert out.emitted == {chat: 1}  # a prompt that fits one chunk emits its first token
    doc = Sequence(prompt_tokens=1000, max_tokens=5)
    e.add(doc, out.duration)
    out = e.step(out.duration)
    # The chat sequence keeps decoding while the document's first chunk (255 tokens) runs.
    assert out.emitted == {chat: 2} and doc.prefill_left == 1000 - 255
    assert out.duration == pytest.approx(
        (cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 0.255) / 1000 + e.decode_ms(1, chat.kv_tokens(-1), 0) / 1000)
    drive(e)
    assert chat.generated == 50 and doc.generated == 5 and e.preemptions_total == 0
    assert e.free_blocks == e.total_blocks


def test_chunked_prefill_without_room_to_grow_preempts_like_whole_prefill() -> None:
    # The same overload as test_engine_runs_out_of_kv_and_preempts, scheduled the V1 way.
    e = Engine(SimConfig(kv_blocks=64, block_size=16, chunked_prefill=True))
    seqs = [Sequence(prompt_tokens=200, max_tokens=200, natural_stop=True) for _ in range(8)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    assert e.preemptions_total > 0
    assert all(s.state == "finished" and s.generated == 200 and s.finish_reason == "stop" for s in seqs)
    assert e.free_blocks == e.total_blocks
