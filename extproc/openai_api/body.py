"""Reading OpenAI-style request bodies: validation, prompt text, the upstream rewrite.

Pure functions. Every failure is a ``BadRequest`` naming the offending field so the
client sees an OpenAI-shaped 400 it can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from extproc.openai_api import responses as responses_api

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
# OpenAI's published accounting for chat formatting: every message is wrapped in
# a few special tokens, and the reply is primed with a few more.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
MAX_N = 128


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class ParsedRequest:
    kind: str
    model: str
    body: dict[str, Any]
    stream: bool = False
    usage_requested: bool = False  # the client itself asked for the usage chunk
    n: int = 1  # completions generated: n × number of prompts
    max_tokens: int | None = None  # what the client asked for, if anything
    texts: list[str] = field(default_factory=list)  # to be tokenized
    fixed_tokens: int = 0  # counted without tokenizing (token-id prompts, chat overhead, images)
    # Embeddings: each input is its own sequence, held to the context window alone. The
    # input index of each entry of ``texts``, and each token-id input as (index, length).
    text_inputs: list[int] = field(default_factory=list)
    id_inputs: list[tuple[int, int]] = field(default_factory=list)

    def text_bytes(self) -> int:
        return sum(len(t) for t in self.texts)


def path_kind(path: str) -> str | None:
    return ENDPOINTS.get(path.split("?", 1)[0])


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN/Infinity; JSON does not, and re-serialising them
    # would send the backend a body it cannot parse.
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (math.inf, -math.inf):
        raise ValueError(f"number {text[:32]} is out of range")
    return v


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` refusing a key repeated in one object (``DuplicateKey``).

    Python keeps the last of repeated keys, a backend may keep the first: the body Sluice
    accounts for must be the one the backend reads (and a replica's report the one it meant)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k)
            seen.add(k)
    return d


# Built once: json.loads with any keyword builds a decoder and its scanner on every call
# (~3 µs of a small body's 8).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=unique_keys)


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding") from None
    try:
        body = _DECODER.decode(text)
    except DuplicateKey as exc:
        raise BadRequest(f"request body has the key {exc.key!r} more than once in one object", exc.key,
                         "duplicate_key") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                         code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body JSON is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's 4300-digit limit
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{key}' must be {rng}, got {v}", key, "invalid_value")
    return v


def _bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        param = param or key
        raise BadRequest(f"'{param}' must be a boolean, got {type(v).__name__}", param, "invalid_type")
    return v


def _prompt_like(value: Any, param: str, req: ParsedRequest) -> int:
    """Strings, token-id lists, or lists of either; returns how many prompts (each one's
    place is kept in ``text_inputs`` / ``id_inputs``)."""
    if isinstance(value, str):
        req.texts.append(value)
        req.text_inputs.append(0)
        return 1
    if isinstance(value, list) and value:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            req.fixed_tokens += len(value)
            req.id_inputs.append((0, len(value)))
            return 1
        count = 0
        for i, item in enumerate(value):
            if isinstance(item, str):
                req.texts.append(item)
                req.text_inputs.append(i)
            elif isinstance(item, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
                req.fixed_tokens += len(item)
                req.id_inputs.append((i, len(item)))
            else:
                raise BadRequest(f"'{param}[{i}]' must be a string or an array of token ids", f"{param}[{i}]",
                                 "invalid_type")
            count += 1
        return count
    raise BadRequest(f"'{param}' must be a non-empty string or array", param, "invalid_type")


def _chat_messages(body: dict[str, Any], req: ParsedRequest, image_tokens: int) -> None:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is a required property", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages", "invalid_type")
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"'{p}.role' is required and must be a string", f"{p}.role", "invalid_type")
        req.fixed_tokens += TOKENS_PER_MESSAGE
        req.texts.append(role)
        content = m.get("content")
        if isinstance(content, str):
            req.texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                pp = f"{p}.content[{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(f"'{pp}' must be an object with a 'type'", pp, "invalid_type")
                if part["type"] == "text":
                    if not isinstance(part.get("text"), str):
                        raise BadRequest(f"'{pp}.text' must be a string", f"{pp}.text", "invalid_type")
                    req.texts.append(part["text"])
                elif part["type"] in ("image_url", "input_image"):
                    req.fixed_tokens += image_tokens
                else:
                    req.texts.append(json.dumps(part, ensure_ascii=False))
        elif content is not None:
            raise BadRequest(f"'{p}.content' must be a string, an array or null", f"{p}.content", "invalid_type")
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise BadRequest(f"'{p}.name' must be a string", f"{p}.name", "invalid_type")
            req.texts.append(name)
            req.fixed_tokens += TOKENS_PER_NAME
        for extra in ("tool_calls", "function_call"):
            if m.get(extra) is not None:
                req.texts.append(json.dumps(m[extra], ensure_ascii=False))
    req.fixed_tokens += REPLY_PRIMING
    # Tool and function definitions are part of the prompt the model sees.
    for extra in ("tools", "functions", "response_format"):
        if body.get(extra) is not None:
            req.texts.append(json.dumps(body[extra], ensure_ascii=False))


def _responses(body: dict[str, Any], req: ParsedRequest, image_tokens: int) -> None:
    """The Responses API: one completion, ``max_output_tokens``, usage always in the reply."""
    if _bool(body, "background"):
        # The reply comes before the generation, its usage never through Sluice: unaccountable.
        raise BadRequest("'background' responses are not supported through this gateway", "background",
                         "unsupported_value")
    req.max_tokens = _int(body, "max_output_tokens", 1)
    try:
        parts = responses_api.prompt_parts(body, image_tokens)
    except responses_api.InvalidInput as exc:
        code = "missing_field" if exc.param == "input" and "required" in exc.message else "invalid_type"
        raise BadRequest(exc.message, exc.param, code) from None
    req.texts, req.fixed_tokens = parts.texts, parts.fixed_tokens


def parse_request(kind: str, raw: bytes, image_tokens: int = 765) -> ParsedRequest:
    body = decode_json(raw)
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is a required property", "model", "missing_field")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model", "invalid_type")
    req = ParsedRequest(kind=kind, model=model, body=body)
    if kind == "embeddings":
        if "input" not in body:
            raise BadRequest("'input' is a required property", "input", "missing_field")
        _prompt_like(body["input"], "input", req)
        req.n = 0  # nothing is generated
        return req
    req.stream = _bool(body, "stream")
    if kind == "responses":
        _responses(body, req, image_tokens)
        return req
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
        if not req.stream:
            # OpenAI refuses it too; passed on, the backend's 400 would carry no x-sluice-reason.
            raise BadRequest("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                             "stream_options", "invalid_value")
        req.usage_requested = _bool(opts, "include_usage", "stream_options.include_usage")
    n = _int(body, "n", 1, MAX_N) or 1
    mct = _int(body, "max_completion_tokens", 1)
    mt = _int(body, "max_tokens", 1)
    req.max_tokens = mct if mct is not None else mt
    if kind == "chat":
        _chat_messages(body, req, image_tokens)
        req.n = n
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is a required property", "prompt", "missing_field")
        prompts = _prompt_like(body["prompt"], "prompt", req)
        best_of = _int(body, "best_of", 1, MAX_N) or 1
        req.n = prompts * max(n, best_of)
    return req


def upstream_body(req: ParsedRequest, max_tokens: int, model: str | None = None,
                  priority: int | None = None) -> bytes | None:
    """The body to send upstream, or None when the client's bytes can go unchanged.

    The reservation is only honest if the backend generates no more than was
    reserved, so a missing or larger ``max_tokens`` is written into the body; a
    stream must end with a usage chunk for an exact settle, so it is asked for.
    ``model`` names a fallback model the request is degraded to; ``priority`` is the
    engine's scheduling priority (``extproc.request.upstream.engine_priority``), written over
    whatever
    the client sent: a client does not choose its own place in the engine's queue.
    """
    body = req.body
    changed = False
    if model is not None and model != req.model:
        body["model"] = model
        changed = True
    if priority is not None and (
        body.get("priority") != priority or isinstance(body.get("priority"), bool)
    ):
        body["priority"] = priority
        changed = True
    if req.kind == "embeddings":
        pass
    elif req.kind == "responses":
        if req.max_tokens != max_tokens:
            body["max_output_tokens"] = max_tokens
            changed = True
    elif req.max_tokens != max_tokens:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        body[key] = max_tokens
        if key == "max_completion_tokens" and "max_tokens" in body:
            body["max_tokens"] = max_tokens
        changed = True
    # The Responses API always reports usage in its final event: nothing to ask for.
    if req.kind in ("chat", "completions") and req.stream and not req.usage_requested:
        opts = body.get("stream_options") or {}
        body["stream_options"] = {**opts, "include_usage": True}
        changed = True
    if not changed:
        return None
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800" in the client's JSON) has no UTF-8 form: keep it escaped.
        return json.dumps(body, separators=(",", ":")).encode("ascii")
