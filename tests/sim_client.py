"""Talking to the simulated vLLM backend in tests: an in-process server, request bodies,
SSE events, and the encodings it counts with (the ``encodings`` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bench.simbackend import STATE, SimConfig, create_app
from bench.simbackend.app import load_encoding
from bench.simbackend.engine import Engine

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


@pytest.fixture(scope="module", name="encodings")
def encodings_fixture() -> tuple[Any, Any]:
    return load_encoding("cl100k_base"), load_encoding("o200k_base")


def chat_prompt_tokens(enc: Any, *texts: str) -> int:
    """OpenAI's accounting for user messages: role and content tokens, 3 per message, 3 priming."""
    return sum(len(enc.encode_ordinary(t)) + len(enc.encode_ordinary("user")) for t in texts) + 3 * len(texts) + 3


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
