"""Open- and closed-loop load generators: streaming chat completions over aiohttp.

Open loop: each request leaves at its scheduled time whatever happened to the others,
so every configuration sees exactly the same arrivals. Every request streams (SSE) so
time to first token is measurable; the client records status, ``x-sluice-reason``,
``x-sluice-degraded``, TTFT, end-to-end time, the tokens it received and the usage the
server reported. A client that gives up (no first token in time, or too slow overall)
closes its socket, as real ones do: one connection per request (``force_close``), and
an abandoned response is closed, not drained.

Prompts are ``hello`` repeated: one token per word in cl100k and o200k alike; a caller
that needs other prompts (``bench.conversations``) passes ``body``, a function of the
request giving its JSON body, to ``send``, ``OpenLoop`` or ``closed_loop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.trace import Request

CHAT_PATH = "/v1/chat/completions"
# Chat framing the gateway and the backend add to the text: 3 per message + 3 for the reply.
FRAMING_TOKENS = 6


def prompt_text(tokens: int) -> str:
    n = max(1, tokens - FRAMING_TOKENS)
    return "hello" + " hello" * (n - 1)


def chat_body(req: Request, stream: bool = True) -> bytes:
    body: dict[str, object] = {
        "model": req.model,
        "messages": [{"role": "user", "content": prompt_text(req.prompt_tokens)}],
        "max_tokens": req.max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ClientPolicy:
    """When a client gives up: no first token after ``ttft_s``, or not done after ``total_s``."""

    ttft_s: float = 15.0
    total_s: float = 120.0


@dataclass
class Result:
    id: int
    tier: str
    phase: str
    sent: float  # seconds since the run started
    status: int = 0  # 0: no response headers (refused, reset, or gave up before them)
    reason: str = ""  # x-sluice-reason
    degraded: str = ""  # x-sluice-degraded
    head: float | None = None  # when the response headers arrived (since the run started)
    first: float | None = None  # time of the first content token (since the run started)
    end: float | None = None
    tokens: int = 0  # content chunks received (one token each)
    usage_prompt: int | None = None
    usage_completion: int | None = None
    finish: str = ""
    done: bool = False  # the stream ended with [DONE] (or a complete JSON body)
    gave_up: str = ""  # "ttft" | "total" | "disconnect" | "run_end"
    error: str = ""
    model: str = ""  # the model that answered (fallbacks show here)
    retry_after_s: float | None = None  # from retry-after-ms / retry-after on a refusal
    revoked: int = 0  # times the gateway revoked it (503 or an error event, reason "revoked") and it was sent again

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.gave_up

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def usage_total(self) -> int | None:
        if self.usage_prompt is None or self.usage_completion is None:
            return None
        return self.usage_prompt + self.usage_completion


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, force_close=True)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


def _read_event(res: Result, payload: bytes, t0: float, on_first: Callable[[], None]) -> None:
    try:
        obj = json.loads(payload)
    except ValueError:
        res.error = "bad_sse_json"
        return
    if not isinstance(obj, dict):
        return
    err = obj.get("error")
    if isinstance(err, dict):  # an error event ends the stream (a gateway revoking it, say)
        res.error = f"event:{err.get('code') or err.get('type') or 'error'}"
        if err.get("code") == "revoked":
            res.reason = "revoked"
        return
    if obj.get("model"):
        res.model = obj["model"]
    use = obj.get("usage")
    if isinstance(use, dict):
        res.usage_prompt = use.get("prompt_tokens")
        res.usage_completion = use.get("completion_tokens")
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            res.tokens += 1
            if res.first is None:
                res.first = time.monotonic() - t0
                on_first()
        if choice.get("finish_reason"):
            res.finish = choice["finish_reason"]


async def _consume(resp: aiohttp.ClientResponse, res: Result, t0: float, cut_after: int | None,
                   on_first: Callable[[], None]) -> None:
    if "text/event-stream" not in resp.headers.get("content-type", ""):
        body = await resp.read()
        res.first = time.monotonic() - t0
        with contextlib.suppress(ValueError):
            obj = json.loads(body)
            use = obj.get("usage") if isinstance(obj, dict) else None
            if isinstance(use, dict):
                res.usage_prompt, res.usage_completion = use.get("prompt_tokens"), use.get("completion_tokens")
                res.tokens = res.usage_completion or 0
        res.done = True
        return
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            res.done = True
            return
        _read_event(res, payload, t0, on_first)
        if cut_after is not None and res.tokens >= cut_after:
            res.gave_up = "disconnect"
            return


def _retry_after(headers: Mapping[str, str]) -> float | None:
    for name, unit in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        with contextlib.suppress(ValueError, TypeError):
            if headers.get(name) is not None:
                return float(headers[name]) / unit
    return None


async def send(session: aiohttp.ClientSession, base_url: str, key: str, req: Request, t0: float,
               client: ClientPolicy = ClientPolicy(), headers: Mapping[str, str] | None = None,
               cut_after_tokens: int | None = None, stream: bool = True,
               track: dict[int, Result] | None = None, body: bytes | None = None,
               path: str = CHAT_PATH) -> Result:
    """One request; ``cut_after_tokens`` makes the client hang up after that many tokens.

    ``track`` receives the result as soon as it exists, so a caller that cancels the
    request still sees what had arrived.
    """
    res = Result(req.id, req.tier, req.phase, time.monotonic() - t0)
    if track is not None:
        track[req.id] = res
    hdrs = {"authorization": f"Bearer {key}", "content-type": "application/json",
            "x-sim-tokens": str(req.gen_tokens), **(headers or {})}
    resp: aiohttp.ClientResponse | None = None
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        # Patience for the first token; once it arrives, for the whole answer.
        async with asyncio.timeout_at(start + client.ttft_s) as patience:
            data = chat_body(req, stream) if body is None else body
            resp = await session.post(base_url + path, data=data, headers=hdrs)
            res.status, res.head = resp.status, time.monotonic() - t0
            res.reason = resp.headers.get("x-sluice-reason", "")
            res.degraded = resp.headers.get("x-sluice-degraded", "")
            if resp.status != 200:
                res.retry_after_s = _retry_after(resp.headers)
                await resp.read()
                res.done = True
            else:
                await _consume(resp, res, t0, cut_after_tokens,
                               lambda: patience.reschedule(start + client.total_s))
    except TimeoutError:
        res.gave_up = "ttft" if res.first is None else "total"
    except asyncio.CancelledError:
        res.gave_up = res.gave_up or "run_end"
        raise
    except (aiohttp.ClientError, OSError) as exc:
        res.error = type(exc).__name__
    finally:
        res.end = time.monotonic() - t0
        if resp is not None:
            resp.close()  # hang up: an unread body means a closed socket, not a drained one
    return res


@dataclass
class OpenLoop:
    """Fire ``requests`` at their ``at`` times; wait for stragglers at most ``drain_s``."""

    base_url: str
    keys: Mapping[str, str]  # tier -> API key
    client: Mapping[str, ClientPolicy] = field(default_factory=dict)  # tier -> patience
    drain_s: float = 10.0
    headers: Callable[[Request], Mapping[str, str]] | None = None
    body: Callable[[Request], bytes] | None = None  # the request's JSON body; default chat_body
    # Tiers whose clients send a revoked request again after its Retry-After (batch jobs do),
    # within their patience (total_s from the first send).
    retry_revoked: frozenset[str] = frozenset()

    async def _send(
        self,
        session: aiohttp.ClientSession,
        req: Request,
        t0: float,
        policy: ClientPolicy,
        extra: Mapping[str, str] | None,
        live: dict[int, Result],
    ) -> Result:
        first = time.monotonic()
        revoked = 0
        while True:
            res = await send(
                session,
                self.base_url,
                self.keys[req.tier],
                req,
                t0,
                policy,
                extra,
                track=live,
                body=self.body(req) if self.body else None,
            )
            if res.reason != "revoked":
                break
            revoked += 1
            wait = res.retry_after_s if res.retry_after_s is not None else 1.0
            if (
                req.tier not in self.retry_revoked
                or time.monotonic() + wait - first > policy.total_s
            ):
                break
            await asyncio.sleep(wait)
        res.revoked = revoked
        res.sent = first - t0  # the client's wait counts from its first try
        return res

    async def run(self, requests: Sequence[Request], t0: float | None = None) -> list[Result]:
        t0 = time.monotonic() if t0 is None else t0
        results: list[Result] = []
        tasks: list[asyncio.Task[Result]] = []
        live: dict[int, Result] = {}
        async with new_session() as session:
            for req in requests:
                delay = t0 + req.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                extra = self.headers(req) if self.headers else None
                policy = self.client.get(req.tier, ClientPolicy())
                tasks.append(asyncio.create_task(self._send(session, req, t0, policy, extra, live)))
            if tasks:
                await asyncio.wait(tasks, timeout=self.drain_s)
            for t in tasks:
                t.cancel()
            for req, t in zip(requests, tasks, strict=True):
                try:
                    results.append(await t)
                except asyncio.CancelledError:
                    res = live.get(req.id) or Result(req.id, req.tier, req.phase, req.at)
                    res.gave_up = res.gave_up or "run_end"
                    res.end = res.end or time.monotonic() - t0
                    results.append(res)
        return results


async def closed_loop(base_url: str, keys: Mapping[str, str], requests: Iterator[Request], workers: int,
                      seconds: float, t0: float | None = None,
                      on_result: Callable[[Result], Awaitable[None]] | None = None,
                      body: Callable[[Request], bytes] | None = None) -> list[Result]:
    """``workers`` clients, each sending the next request as soon as its last one ends."""
    t0 = time.monotonic() if t0 is None else t0
    stop_at = t0 + seconds
    out: list[Result] = []
    patience = ClientPolicy(ttft_s=seconds + 60, total_s=seconds + 120)

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop_at:
            try:
                req = next(requests)
            except StopIteration:
                return
            res = await send(session, base_url, keys[req.tier], req, t0, patience,
                             body=body(req) if body else None)
            out.append(res)
            if on_result is not None:
                await on_result(res)

    async with new_session() as session:
        jobs = [asyncio.create_task(worker(session)) for _ in range(workers)]
        done, pending = await asyncio.wait(jobs, timeout=seconds + 5)
        for j in pending:
            j.cancel()
        for j in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await j
    return out
