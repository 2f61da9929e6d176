"""OpenAI/vLLM response bodies, SSE chunks and the generated text.

The generated text is a rotation of common English words, each with a leading space.
Every word is exactly one token in both cl100k_base and o200k_base and the pre-tokenizer
splits at each leading space, so a text of N words is N tokens in either encoding: a
gateway that counts tokens in the stream gets the same number the usage reports.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import uuid
from typing import Any

_WORD_LIST = (
    "the of and to in is that for it with as on was by at be this from are or an have "
    "not but which one all were we when there can more so some time like what about "
    "out into only up other new model data system will each make first over after "
    "also most made"
)
WORDS: tuple[str, ...] = tuple(" " + w for w in _WORD_LIST.split())

SSE_DONE = b"data: [DONE]\n\n"


def token_text(choice: int, i: int) -> str:
    # Choices start at different words so n > 1 gives distinguishable texts.
    return WORDS[(i + 7 * choice) % len(WORDS)]


def generated_text(choice: int, count: int, start: int = 0) -> str:
    return "".join(token_text(choice, i) for i in range(start, count))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """``cached_tokens``: prompt tokens served from the prefix cache, reported as vLLM does
    with prefix caching on (``prompt_tokens_details``); None leaves the details out."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def error_body(
    message: str, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    if status >= 500:
        etype = "server_error"
    elif status == 429:
        etype = "rate_limit_error"
    elif status == 404:
        etype = "not_found_error"
    else:
        etype = "invalid_request_error"
    return {
        "error": {"message": message, "type": etype, "code": code or str(status), "param": param}
    }


def _response(
    rid: str, obj: str, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": now_s(),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def chat_response(
    rid: str,
    model: str,
    texts: list[str],
    finish_reason: str,
    use: dict[str, int] | None,
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        for i, text in enumerate(texts)
    ]
    return _response(rid, "chat.completion", model, choices, use)


def completion_response(
    rid: str,
    model: str,
    texts: list[str],
    finish_reason: str,
    use: dict[str, int] | None,
) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason}
        for i, text in enumerate(texts)
    ]
    return _response(rid, "text_completion", model, choices, use)


def embedding_vector(item: Any, dim: int) -> list[float]:
    """A deterministic unit vector per input, so equal inputs embed equally."""
    digest = hashlib.sha256(json.dumps(item).encode()).digest()
    while len(digest) < 4 * dim:
        digest += hashlib.sha256(digest).digest()
    raw = [v / 2**31 - 1.0 for v in struct.unpack(f"<{dim}I", digest[: 4 * dim])]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def embedding_response(
    model: str, items: list[Any], dim: int, use: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": new_id("embd"),
        "object": "list",
        "created": now_s(),
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": embedding_vector(item, dim)}
            for i, item in enumerate(items)
        ],
    }
    if use is not None:
        # Embeddings have no completion: OpenAI reports only these two.
        body["usage"] = {
            "prompt_tokens": use["prompt_tokens"],
            "total_tokens": use["prompt_tokens"],
        }
    return body


class ChunkMaker:
    """Builds the SSE events of one streamed response (chat or completions)."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.created = now_s()
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _event(self, choices: list[dict[str, Any]], use: Any = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            # OpenAI: with include_usage every chunk carries "usage": null until the last.
            obj["usage"] = use
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def role(self, choice: int) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self._event(
            [{"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def token(self, choice: int, text: str, finish_reason: str | None = None) -> bytes:
        if self.kind == "chat":
            c: dict[str, Any] = {"index": choice, "delta": {"content": text}}
        else:
            c = {"index": choice, "text": text}
        c["logprobs"] = None
        c["finish_reason"] = finish_reason
        return self._event([c])

    def usage(self, use: dict[str, int]) -> bytes:
        return self._event([], use)


# ---- the Responses API (/v1/responses) ---------------------------------------------------
def responses_usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


class ResponseMaker:
    """The response object and the SSE events of one Responses API reply, as vLLM sends them."""

    def __init__(self, model: str, instructions: str | None, max_output_tokens: int | None) -> None:
        self.rid = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.instructions = instructions
        self.max_output_tokens = max_output_tokens
        self.created_at = now_s()
        self.seq = 0

    def response(
        self, status: str, text: str | None, use: dict[str, Any] | None
    ) -> dict[str, Any]:
        incomplete = status == "incomplete"
        output = [] if text is None else [_message_item(self.item_id, text, "completed")]
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": use,
            "user": None,
        }

    def final(self, text: str, finish_reason: str, use: dict[str, Any] | None) -> dict[str, Any]:
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, text, use)

    def _event(self, etype: str, **fields: Any) -> bytes:
        obj = {"type": etype, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(obj, separators=(",", ":"))
        return f"event: {etype}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        return [
            self._event("response.created", response=self.response("in_progress", None, None)),
            self._event("response.in_progress", response=self.response("in_progress", None, None)),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=_message_item(self.item_id, None, "in_progress"),
            ),
            self._event("response.content_part.added", **at, part=_output_text("")),
        ]

    def delta(self, text: str) -> bytes:
        return self._event(
            "response.output_text.delta",
            output_index=0,
            item_id=self.item_id,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, text: str, finish_reason: str, use: dict[str, Any] | None) -> list[bytes]:
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        final = self.final(text, finish_reason, use)
        return [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=_output_text(text)),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=_message_item(self.item_id, text, "completed"),
            ),
            self._event(f"response.{final['status']}", response=final),
        ]
