"""Validating OpenAI request bodies, counting prompt tokens, reading x-sim-* headers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import tiktoken

# Chat framing as OpenAI's cookbook counts it: a few tokens per message and for the reply.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3
MAX_N = 128


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class GenRequest:
    kind: str  # chat | completion | embedding | responses
    model: str | None
    texts: list[str] = field(default_factory=list)  # counted with the tokenizer
    id_tokens: int = 0  # prompts given as token ids count as their length
    messages: int = 0
    choices: int = 1  # n, times the number of prompts for batched completions
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    items: list[Any] = field(default_factory=list)  # embedding inputs, one vector each
    instructions: str | None = None  # Responses API: echoed in the response object
    priority: int = 0  # vLLM's scheduling priority (lower first; only with --scheduling-policy priority)
    starts: list[int] = field(default_factory=list)  # chat: index in texts where each message begins

    @property
    def text_chars(self) -> int:
        return sum(len(t) for t in self.texts)


def _is_token_ids(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    )


def _common(body: Any, kind: str) -> GenRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    req = GenRequest(kind=kind, model=model)
    req.priority = _priority(body)
    if kind == "embedding":
        return req
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer between 1 and {MAX_N}", "n")
    req.choices = n
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadRequest(f"{name} must be at least 1, got {v!r}", name)
        req.max_tokens = v
        break
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest("stream must be a boolean", "stream")
    req.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        if not req.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        req.include_usage = bool(opts.get("include_usage"))
    return req


def check_priority(req: GenRequest, scheduling_policy: str) -> None:
    """vLLM refuses a priority it cannot honour rather than ignore it (its engine's add_request)."""
    if req.priority != 0 and scheduling_policy != "priority":
        raise BadRequest(f"Got priority {req.priority} but Priority scheduling is not enabled.",
                         "priority", "invalid_request_error")


def _priority(body: dict[str, Any]) -> int:
    v = body.get("priority", 0)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest("priority must be an integer", "priority")
    return v


def parse_chat(body: Any) -> GenRequest:
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        # OpenAI's accounting tokenizes the role too (as the gateway does).
        req.starts.append(len(req.texts))
        req.texts.append(msg["role"])
        content = msg.get("content")
        if isinstance(content, str):
            req.texts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise BadRequest(f"messages[{i}] text part needs a string", "messages")
                    req.texts.append(text)
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string or a list", "messages")
    req.messages = len(messages)
    return req


_TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses(body: Any) -> GenRequest:
    """The Responses API: ``input`` (a string or message items), ``instructions``,
    ``max_output_tokens``. vLLM renders it through the chat template, so the prompt is
    counted as chat messages (``instructions`` first, as a system message)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    req = GenRequest(kind="responses", model=model)
    req.priority = _priority(body)
    v = body.get("max_output_tokens")
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadRequest(f"max_output_tokens must be at least 1, got {v!r}", "max_output_tokens")
        req.max_tokens = v
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise BadRequest("stream must be a boolean", "stream")
    req.stream = bool(stream)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", "instructions")
        req.instructions = instructions
        req.starts.append(len(req.texts))
        req.texts += ["system", instructions]
        req.messages += 1
    value = body.get("input")
    if isinstance(value, str):
        req.starts.append(len(req.texts))
        req.texts += ["user", value]
        req.messages += 1
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                raise BadRequest(f"input[{i}] must be a message with a role", "input")
            req.starts.append(len(req.texts))
            req.texts.append(item["role"])
            content = item.get("content")
            if isinstance(content, str):
                req.texts.append(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                        if not isinstance(part.get("text"), str):
                            raise BadRequest(f"input[{i}] text part needs a string", "input")
                        req.texts.append(part["text"])
            else:
                raise BadRequest(f"input[{i}].content must be a string or a list", "input")
            req.messages += 1
    else:
        raise BadRequest("input must be a string or a non-empty list of messages", "input")
    return req


def _prompts(value: Any, param: str, req: GenRequest) -> int:
    """Collect str / [str] / [int] / [[int]] prompts into ``req``; returns how many."""
    if isinstance(value, str):
        req.texts.append(value)
        return 1
    if _is_token_ids(value):
        req.id_tokens += len(value)
        return 1
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            req.texts.extend(value)
            return len(value)
        if all(_is_token_ids(v) for v in value):
            req.id_tokens += sum(len(v) for v in value)
            return len(value)
    raise BadRequest(
        f"{param} must be a string, a list of strings, or token ids (list or list of lists)",
        param,
    )


def parse_completion(body: Any) -> GenRequest:
    req = _common(body, "completion")
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    req.choices *= _prompts(body["prompt"], "prompt", req)
    return req


def parse_embedding(body: Any) -> GenRequest:
    req = _common(body, "embedding")
    value = body.get("input")
    _prompts(value, "input", req)
    if isinstance(value, str) or _is_token_ids(value):
        req.items = [value]
    else:
        req.items = list(value)
    return req


def count_prompt(req: GenRequest, enc: tiktoken.Encoding) -> int:
    tokens = req.id_tokens + sum(len(t) for t in enc.encode_ordinary_batch(req.texts))
    if req.kind in ("chat", "responses"):
        tokens += TOKENS_PER_MESSAGE * req.messages + TOKENS_PER_REPLY
    return tokens


def prompt_token_ids(req: GenRequest, enc: tiktoken.Encoding) -> tuple[int, list[int] | None]:
    """The prompt's token count (as ``count_prompt``) and, where the sim can render it, its
    token ids in order: each chat message is framed by TOKENS_PER_MESSAGE marker ids
    (negative: no real token collides) before its role, the reply by TOKENS_PER_REPLY at
    the end, as a chat template renders them. Prompts given as token ids, and batched
    completions (one sequence per prompt in vLLM, one here), have no ids: never cached."""
    encoded = enc.encode_ordinary_batch(req.texts)
    count = req.id_tokens + sum(len(t) for t in encoded)
    chat = req.kind in ("chat", "responses")
    if chat:
        count += TOKENS_PER_MESSAGE * req.messages + TOKENS_PER_REPLY
    if req.id_tokens or (not chat and len(req.texts) != 1):
        return count, None
    ids: list[int] = []
    starts = set(req.starts)
    for i, toks in enumerate(encoded):
        if i in starts:
            ids.extend(range(-1, -TOKENS_PER_MESSAGE - 1, -1))
        ids.extend(toks)
    if chat:
        ids.extend(range(-TOKENS_PER_MESSAGE - 1, -TOKENS_PER_MESSAGE - TOKENS_PER_REPLY - 1, -1))
    return count, ids


def count_items(req: GenRequest, enc: tiktoken.Encoding) -> list[int]:
    """Tokens per embedding input (each is checked against the context length alone)."""
    texts = [item for item in req.items if isinstance(item, str)]
    text_counts = iter(len(t) for t in enc.encode_ordinary_batch(texts))
    return [next(text_counts) if isinstance(item, str) else len(item) for item in req.items]


@dataclass
class SimHeaders:
    status: int | None = None
    delay_ms: float = 0.0
    usage_none: bool = False
    tokens: int | None = None
    tps: float | None = None
    fail_after: int | None = None


def _number(headers: Mapping[str, str], name: str, minimum: float, integer: bool) -> Any:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        raise BadRequest(f"header {name} must be a number, got {raw!r}", name) from None
    if value < minimum:
        raise BadRequest(f"header {name} must be >= {minimum}", name)
    return value


def parse_sim_headers(headers: Mapping[str, str]) -> SimHeaders:
    sim = SimHeaders()
    status = _number(headers, "x-sim-status", 400, True)
    if status is not None and status > 599:
        raise BadRequest("header x-sim-status must be an error status (400-599)", "x-sim-status")
    sim.status = status
    sim.delay_ms = _number(headers, "x-sim-delay-ms", 0, False) or 0.0
    sim.usage_none = headers.get("x-sim-usage", "").strip().lower() == "none"
    sim.tokens = _number(headers, "x-sim-tokens", 0, True)
    tps = _number(headers, "x-sim-tps", 0, False)
    if tps == 0:
        raise BadRequest("header x-sim-tps must be > 0", "x-sim-tps")
    sim.tps = tps
    sim.fail_after = _number(headers, "x-sim-fail-after", 0, True)
    return sim
