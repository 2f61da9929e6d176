"""The aiohttp application: OpenAI endpoints, admin endpoints, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import tiktoken
from aiohttp import web

from extproc.tokens import encodings

from . import openai_fmt as fmt
from .config import LiveConfig, SimConfig, parse_live_update
from .engine import Engine, Sequence
from .metrics import CONTENT_TYPE, SimCollector, engine_report, make_registry, render
from .parse import (
    BadRequest,
    GenRequest,
    check_priority,
    count_items,
    parse_chat,
    parse_completion,
    parse_embedding,
    parse_responses,
    parse_sim_headers,
    prompt_token_ids,
)
from .prefix_cache import block_hashes
from .scheduler import ScaledClock, Scheduler
from .stream import Job, complete, stream, stream_responses

# Prompts larger than this are tokenized in a thread so the event loop keeps streaming.
OFFLOAD_CHARS = 8 * 1024
NOT_RECORDED = ("/admin/", "/metrics", "/health")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> web.Response:
    return web.json_response(fmt.error_body(message, status, code, param), status=status)


class SimState:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.live = LiveConfig(mode=config.mode, time_scale=config.time_scale)
        self.clock = ScaledClock(config.time_scale)
        self.engine = Engine(config)
        self.scheduler = Scheduler(self.engine, self.clock)
        self.records: deque[dict[str, Any]] = deque(maxlen=config.record_limit)
        self.registry = make_registry(
            SimCollector(self.engine, config.model, lambda: self.live.kv_usage_override)
        )
        self.encoding: tiktoken.Encoding | None = None

    def apply(self, update: dict[str, Any]) -> None:
        slowdown = update.pop("slowdown", None)
        if slowdown is not None:
            self.scheduler.slow_down(slowdown["factor"], slowdown["seconds"])
        for key, value in update.items():
            setattr(self.live, key, value)
        self.engine.mode = self.live.mode
        if self.clock.scale != self.live.time_scale:
            self.clock.set_scale(self.live.time_scale)
        self.scheduler.wake()


STATE = web.AppKey("sluice_sim_state", SimState)
# The body, parsed once by the recording middleware.
PARSED = web.RequestKey("sluice_sim_json", object)


def load_encoding(name: str = "cl100k_base") -> tiktoken.Encoding:
    return encodings.get_encoding(name)


# ---- middlewares ------------------------------------------------------------------------
def _header_dict(request: web.Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in request.headers.items():
        k = key.lower()
        out[k] = f"{out[k]}, {value}" if k in out else value
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def record_and_program(request: web.Request, handler: Handler) -> web.StreamResponse:
    st = request.app[STATE]
    path = request.path
    if not path.startswith(NOT_RECORDED):
        raw = await request.read()
        parsed: Any = None
        if raw:
            with contextlib.suppress(ValueError):
                parsed = json.loads(raw)
                request[PARSED] = parsed
        st.records.append(
            {
                "method": request.method,
                "path": path,
                "query": request.query_string,
                "headers": _header_dict(request),
                "body_len": len(raw),
                "json": parsed,
                "time": time.time(),
            }
        )
    try:
        if path.startswith("/v1/"):
            if st.live.fail_status is not None:
                raise ApiError(
                    st.live.fail_status,
                    "simulated backend failure (admin fail_status)",
                    "simulated_failure",
                )
            sim = parse_sim_headers(request.headers)
            if sim.status is not None:
                raise ApiError(
                    sim.status, f"simulated error {sim.status} (x-sim-status)", "simulated_failure"
                )
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.code, exc.param)
    except BadRequest as exc:
        return error_response(400, exc.message, exc.code, exc.param)
    except web.HTTPException as exc:
        if not path.startswith("/v1/") or exc.status < 400:
            raise
        return error_response(exc.status, f"{exc.reason}: {request.method} {path}")


# ---- OpenAI endpoints ------------------------------------------------------------------
async def _json_body(request: web.Request) -> Any:
    if PARSED in request:
        return request[PARSED]
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None


async def _count(st: SimState, req: GenRequest, counter: Callable[[GenRequest, Any], Any]) -> Any:
    enc = st.encoding
    assert enc is not None, "the encoding is loaded at startup"
    if req.text_chars > OFFLOAD_CHARS:
        return await asyncio.get_running_loop().run_in_executor(None, counter, req, enc)
    return counter(req, enc)


def _plan_length(
    st: SimState, req: GenRequest, prompt: int, sim_tokens: int | None
) -> tuple[int, bool]:
    """Return (tokens to generate, whether reaching them is a natural "stop")."""
    mml = st.config.max_model_len
    explicit = req.max_tokens
    if explicit is not None:
        if prompt + explicit > mml:
            raise ApiError(
                400,
                f"This model's maximum context length is {mml} encodings. However, you "
                f"requested {prompt + explicit} tokens ({prompt} in the messages, {explicit} "
                "in the completion). Please reduce the length of the messages or completion.",
                "context_length_exceeded",
                "max_tokens",
            )
        cap = explicit
    else:
        if prompt >= mml:
            raise ApiError(
                400,
                f"This model's maximum context length is {mml} encodings. However, your "
                f"messages resulted in {prompt} encodings. Please reduce the length of the messages.",
                "context_length_exceeded",
                "messages",
            )
        cap = min(st.config.default_max_tokens, mml - prompt)
    if sim_tokens is not None:
        return min(sim_tokens, cap), sim_tokens <= cap
    return cap, explicit is None and cap == st.config.default_max_tokens


def _who(request: web.Request) -> dict[str, str]:
    """The ids the engine's work record keeps (work.py): Envoy's request id and the
    gateway's tenant."""
    return {"request_id": request.headers.get("x-request-id", ""),
            "tenant": request.headers.get("x-sluice-tenant", "")}


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    body = await _json_body(request)
    parsers = {"chat": parse_chat, "completion": parse_completion, "responses": parse_responses}
    req = parsers[kind](body)
    sim = parse_sim_headers(request.headers)
    caching, block = st.engine.prefix is not None, st.config.block_size

    def count_and_hash(r: GenRequest, enc: tiktoken.Encoding) -> tuple[int, tuple[int, ...]]:
        count, ids = prompt_token_ids(r, enc)
        return count, block_hashes(ids, block) if caching and ids is not None else ()

    check_priority(req, st.config.scheduling_policy)
    prompt, hashes = await _count(st, req, count_and_hash)  # off the loop for large prompts
    target, natural = _plan_length(st, req, prompt, sim.tokens)
    seq = Sequence(
        prompt_tokens=prompt,
        max_tokens=target,
        n=req.choices,
        delay=sim.delay_ms / 1000.0,
        tps=sim.tps,
        natural_stop=natural,
        priority=req.priority,
        **_who(request),
    )
    seq.block_hashes = hashes
    handle = st.scheduler.submit(seq)
    job = Job(request, handle, kind, req.model or st.config.model, req, sim, prompt, caching=caching)
    try:
        if req.stream:
            return await (stream_responses(job) if kind == "responses" else stream(job))
        return await complete(job)
    finally:
        if not handle.done:
            # Disconnect, handler cancellation or a programmed abort: vLLM frees the
            # sequence's KV at once, and so do we.
            st.scheduler.abort(handle)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "responses")


async def embeddings(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    req = parse_embedding(await _json_body(request))
    check_priority(req, st.config.scheduling_policy)
    sim = parse_sim_headers(request.headers)
    counts: list[int] = await _count(st, req, count_items)
    mml = st.config.max_model_len
    for i, n in enumerate(counts):
        if n > mml:
            raise ApiError(
                400,
                f"This model's maximum context length is {mml} encodings. However, input[{i}] "
                f"has {n} encodings. Please reduce the length of the input.",
                "context_length_exceeded",
                "input",
            )
    prompt = sum(counts)
    seq = Sequence(prompt_tokens=prompt, max_tokens=0, delay=sim.delay_ms / 1000.0,
                   priority=req.priority, **_who(request))
    handle = st.scheduler.submit(seq)
    model = req.model or st.config.model
    job = Job(request, handle, "embedding", model, req, sim, prompt, st.config.embedding_dim)
    try:
        return await complete(job)
    finally:
        if not handle.done:
            st.scheduler.abort(handle)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[STATE].config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": fmt.now_s(),
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    # Paused after a simulated OOM is what a restarting server looks like.
    if st.engine.paused(st.clock.now()):
        return web.Response(status=503, text="restarting after OOM")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = render(request.app[STATE].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# ---- admin ----------------------------------------------------------------------------
async def get_requests(request: web.Request) -> web.Response:
    records = list(request.app[STATE].records)
    path = request.query.get("path")
    if path:
        records = [r for r in records if r["path"] == path]
    return web.json_response(records)


async def clear_requests(request: web.Request) -> web.Response:
    request.app[STATE].records.clear()
    return web.json_response({"cleared": True})


async def get_config(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].live.as_dict())


async def post_config(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:
        update = parse_live_update(await _json_body(request))
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_config") from None
    st.apply(update)
    return web.json_response(st.live.as_dict())


async def get_work(request: web.Request) -> web.Response:
    """The engine's per-request work records numbered above ``?after=`` and per-tenant totals."""
    try:
        after = int(request.query.get("after", "0"))
    except ValueError:
        raise ApiError(400, "after must be an integer", "invalid_query") from None
    return web.json_response(request.app[STATE].engine.work.report(after))


async def get_aborts(request: web.Request) -> web.Response:
    """The last aborted requests: x-request-id, wall time (time.time()) the blocks were freed,
    how many, and whether the sequence was waiting or running."""
    return web.json_response(list(request.app[STATE].scheduler.aborts))


async def get_engine(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(engine_report(st.engine, st.scheduler.steps, st.clock.now()))


# ---- assembly ---------------------------------------------------------------------------
async def _on_startup(app: web.Application) -> None:
    st = app[STATE]
    if st.encoding is None:
        st.encoding = await asyncio.get_running_loop().run_in_executor(None, load_encoding)
    st.scheduler.start()


async def _on_shutdown(app: web.Application) -> None:
    await app[STATE].scheduler.stop()


def create_app(config: SimConfig | None = None) -> web.Application:
    # vLLM takes large prompts; aiohttp's 1 MiB default would answer 413 before we count.
    app = web.Application(middlewares=[record_and_program], client_max_size=64 * 1024 * 1024)
    app[STATE] = SimState(config or SimConfig())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/requests", get_requests)
    app.router.add_delete("/admin/requests", clear_requests)
    app.router.add_get("/admin/config", get_config)
    app.router.add_post("/admin/config", post_config)
    app.router.add_get("/admin/engine", get_engine)
    app.router.add_get("/admin/work", get_work)
    app.router.add_get("/admin/aborts", get_aborts)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    return app
