"""Turning a sequence's progress into an HTTP answer: one JSON body, or an SSE stream."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from . import openai_fmt as fmt
from .parse import GenRequest, SimHeaders
from .scheduler import Handle

# How often a waiting handler checks its connection: aiohttp cancels handlers of closed
# connections only when the runner enables handler_cancellation, which callers may not.
POLL_S = 0.25


@dataclass
class Job:
    request: web.Request
    handle: Handle
    kind: str  # chat | completion | embedding | responses
    model: str
    req: GenRequest
    sim: SimHeaders
    prompt_tokens: int
    embedding_dim: int = 8
    caching: bool = False  # the engine caches prefixes: usage says how much of the prompt hit

    @property
    def finish_reason(self) -> str:
        return self.handle.finish_reason or "stop"

    def usage(self) -> dict[str, int] | None:
        if self.sim.usage_none:
            return None
        cached = self.handle.seq.cache_hit_tokens if self.caching else None
        return fmt.usage(self.prompt_tokens, self.handle.visible * self.req.choices, cached)

    def responses_usage(self, output_tokens: int) -> dict[str, object] | None:
        return None if self.sim.usage_none else fmt.responses_usage(self.prompt_tokens, output_tokens)

    def response_maker(self) -> fmt.ResponseMaker:
        return fmt.ResponseMaker(self.model, self.req.instructions, self.req.max_tokens)

    def should_fail(self, sent: int) -> bool:
        return self.sim.fail_after is not None and sent >= self.sim.fail_after


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def hard_close(request: web.Request) -> None:
    """Drop the connection mid-response: the peer sees a body that never completes."""
    transport = request.transport
    if transport is not None:
        transport.abort()


def _error(status: int, message: str) -> web.Response:
    code = "oom" if status == 500 else None
    return web.json_response(fmt.error_body(message, status, code), status=status)


async def complete(job: Job) -> web.StreamResponse:
    handle = job.handle
    while True:
        if job.kind != "embedding" and job.should_fail(handle.visible):
            hard_close(job.request)
            return web.Response(status=500)
        if handle.done:
            break
        await handle.wait(POLL_S)
        if client_gone(job.request):
            return web.Response(status=499)
    if handle.error is not None:
        return _error(*handle.error)
    if job.kind == "embedding":
        return web.json_response(
            fmt.embedding_response(job.model, job.req.items, job.embedding_dim, job.usage())
        )
    texts = [fmt.generated_text(c, handle.visible) for c in range(job.req.choices)]
    if job.kind == "responses":
        final = job.response_maker().final(
            texts[0], job.finish_reason, job.responses_usage(handle.visible)
        )
        return web.json_response(final)
    if job.kind == "chat":
        body = fmt.chat_response(
            fmt.new_id("chatcmpl"), job.model, texts, job.finish_reason, job.usage()
        )
    else:
        body = fmt.completion_response(
            fmt.new_id("cmpl"), job.model, texts, job.finish_reason, job.usage()
        )
    return web.json_response(body)


async def stream(job: Job) -> web.StreamResponse:
    request, handle, n = job.request, job.handle, job.req.choices
    include_usage = job.req.include_usage and not job.sim.usage_none
    prefix = "chatcmpl" if job.kind == "chat" else "cmpl"
    maker = fmt.ChunkMaker(job.kind, fmt.new_id(prefix), job.model, include_usage)
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    # Like vLLM, headers go out before the first token: later failures can only abort.
    await resp.prepare(request)
    sent = 0
    started = False
    try:
        while True:
            upto = handle.visible
            if job.sim.fail_after is not None:
                upto = min(upto, job.sim.fail_after)
            aborting = job.should_fail(upto)
            finishing = handle.done and handle.error is None and not aborting
            if not started and (upto > sent or finishing):
                started = True
                if job.kind == "chat":
                    for c in range(n):
                        await resp.write(maker.role(c))
            for i in range(sent, upto):
                reason = job.finish_reason if finishing and i == upto - 1 else None
                for c in range(n):
                    await resp.write(maker.token(c, fmt.token_text(c, i), reason))
            wrote_finish = finishing and upto > sent
            sent = upto
            if aborting or handle.error is not None:
                hard_close(request)
                return resp
            if finishing:
                if not wrote_finish:
                    for c in range(n):
                        await resp.write(maker.token(c, "", job.finish_reason))
                if include_usage:
                    await resp.write(maker.usage(fmt.usage(job.prompt_tokens, sent * n)))
                await resp.write(fmt.SSE_DONE)
                await resp.write_eof()
                return resp
            await handle.wait(POLL_S)
            if client_gone(request):
                return resp
    except ConnectionError:
        # The client went away mid-write; the caller aborts the sequence.
        return resp


async def stream_responses(job: Job) -> web.StreamResponse:
    """A Responses API stream: typed events, usage only in the final ``response.completed``."""
    request, handle = job.request, job.handle
    maker = job.response_maker()
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    for event in maker.opening():
        await resp.write(event)
    sent = 0
    try:
        while True:
            upto = handle.visible
            if job.sim.fail_after is not None:
                upto = min(upto, job.sim.fail_after)
            for i in range(sent, upto):
                await resp.write(maker.delta(fmt.token_text(0, i)))
            sent = upto
            if job.should_fail(upto) or handle.error is not None:
                hard_close(request)
                return resp
            if handle.done:
                text = fmt.generated_text(0, sent)
                for event in maker.closing(text, job.finish_reason, job.responses_usage(sent)):
                    await resp.write(event)
                await resp.write_eof()
                return resp
            await handle.wait(POLL_S)
            if client_gone(request):
                return resp
    except ConnectionError:
        return resp
