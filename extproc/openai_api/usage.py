"""Watching a backend's response go by: usage extraction for JSON and SSE bodies.

Pure. ``SSETracker.feed`` is called with each streamed chunk and returns either
None (forward the chunk untouched, the common case) or replacement bytes. It holds
back an incomplete trailing event so the usage chunk Sluice asked for on the
client's behalf can be removed whole, even when it straddles two chunks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from extproc.openai_api import responses as responses_api

_EVENT_END = re.compile(rb"\r?\n\r?\n")
MAX_JSON_BODY = 8 << 20
TAIL_BYTES = 4096  # of a body read for its trailing usage object only
MAX_HELD_EVENT = (
    1 << 20
)  # the most of one unfinished SSE event held back  # non-streaming bodies larger than this are not parsed for usage


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt, served from the engine's prefix cache (priced apart)

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _count(v: Any) -> bool:
    # bool is an int in Python; `"completion_tokens": true` is not a count.
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def usage_from(obj: Any) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    p = u.get("prompt_tokens")
    c = u.get("completion_tokens", 0)
    if not _count(p) or not _count(c):
        return None
    total = u.get("total_tokens")
    if c == 0 and _count(total) and total > p:
        c = total - p
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(p, c, min(cached, p) if _count(cached) else 0)


def _from_responses(u: responses_api.ResponsesUsage | None) -> Usage | None:
    return None if u is None else Usage(u.input_tokens, u.output_tokens, u.cached_tokens)


def _choice_texts(obj: dict[str, Any]) -> list[str]:
    out: list[str] = []
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return out
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        for holder in (ch.get("delta"), ch.get("message")):
            if isinstance(holder, dict):
                if isinstance(holder.get("content"), str):
                    out.append(holder["content"])
                if isinstance(holder.get("reasoning_content"), str):
                    out.append(holder["reasoning_content"])
                if holder.get("tool_calls"):
                    out.append(json.dumps(holder["tool_calls"], ensure_ascii=False))
        if isinstance(ch.get("text"), str):
            out.append(ch["text"])
    return out


@dataclass
class SSETracker:
    drop_usage_chunk: bool
    responses: bool = False  # a Responses API stream: usage in its final event, never dropped
    usage: Usage | None = None
    texts: list[str] = field(default_factory=list)
    uncounted: int = 0  # completion tokens estimated without reading their events (UsageOnlyTracker)
    _pending: bytes = b""

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        data = self._pending + chunk if self._pending else chunk
        held_before = bool(self._pending)
        cut = 0
        for m in _EVENT_END.finditer(data):
            cut = m.end()
        complete, tail = data[:cut], data[cut:]
        if end_of_stream or len(tail) > MAX_HELD_EVENT:
            # An event this large is not an OpenAI chunk; pass it on rather than hold it forever.
            complete, tail = data, b""
        kept: list[bytes] = []
        dropped = False
        start = 0
        for m in _EVENT_END.finditer(complete):
            event = complete[start:m.end()]
            start = m.end()
            if self._inspect(event):
                dropped = True
            else:
                kept.append(event)
        if start < len(complete):  # end of stream without a final blank line
            event = complete[start:]
            if self._inspect(event):
                dropped = True
            else:
                kept.append(event)
        self._pending = tail
        if not dropped and not tail and not held_before:
            return None
        return b"".join(kept)

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; True when it must be dropped."""
        payload = b"".join(
            line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return False
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
        if not isinstance(obj, dict):
            return False
        if self.responses:
            self.usage = _from_responses(responses_api.usage_of_event(obj)) or self.usage
            self.texts.extend(responses_api.texts_of_event(obj))
            return False
        u = usage_from(obj)
        if u is not None:
            self.usage = u
            # The usage-only chunk exists because we asked for it: the client did not.
            if self.drop_usage_chunk and not obj.get("choices"):
                return True
        self.texts.extend(_choice_texts(obj))
        return False


def usage_in_tail(tail: bytes) -> Usage | None:
    """The ``usage`` object of a JSON body from its last bytes (where OpenAI and vLLM put it)."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    colon = tail.find(b":", at + 7)
    try:
        obj, _ = json.JSONDecoder().raw_decode(tail[colon + 1:].decode("utf-8", "replace").lstrip())
    except (ValueError, RecursionError):
        return None
    return usage_from({"usage": obj}) if colon >= 0 else None


@dataclass
class UsageOnlyTracker(SSETracker):
    """An SSE stream watched for its usage chunk alone (picker mode: the echo of every event is
    on the hot path). A chunk of whole events with no ``usage`` object in it is counted, not
    parsed: ``uncounted`` completion tokens, one per event, as vLLM streams one token per
    event; settle adds them only when no usage arrives (a stream cut short). A chunk that
    may hold the usage, or an event split across chunks, is read as ``SSETracker`` reads it."""

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        if not self._pending and not end_of_stream and chunk.endswith(b"\n\n") \
                and b'"usage":{' not in chunk and b'"usage": {' not in chunk:
            self.uncounted += chunk.count(b"data: {") + chunk.count(b"data:{")
            return None
        return super().feed(chunk, end_of_stream)


@dataclass
class JSONTracker:
    """A non-streaming body: collected (bounded) and read once at the end. With ``tail`` only
    its last ``TAIL_BYTES`` are kept and only the usage is read: an embeddings body is mostly
    vectors (a few KB per input, so megabytes for a long list), and its usage comes last."""

    body: bytearray = field(default_factory=bytearray)
    overflow: bool = False
    responses: bool = False  # a Responses API body ("object": "response")
    usage: Usage | None = None
    texts: list[str] = field(default_factory=list)
    ended: bool = False  # the whole body went by (``texts`` is then all that was generated)
    tail: bool = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        self.ended = self.ended or end_of_stream
        if self.tail:
            self.body += chunk
            del self.body[:-TAIL_BYTES]
            if end_of_stream:
                self.usage = usage_in_tail(bytes(self.body))
                self.body.clear()
            return
        if not self.overflow:
            if len(self.body) + len(chunk) > MAX_JSON_BODY:
                self.overflow = True
                self.body.clear()
            else:
                self.body += chunk
        if end_of_stream and not self.overflow and self.body:
            try:
                obj = json.loads(bytes(self.body))
            except (ValueError, UnicodeDecodeError, RecursionError):
                return
            finally:
                self.body.clear()
            if isinstance(obj, dict) and self.responses:
                self.usage = _from_responses(responses_api.usage_of_body(obj))
                self.texts = responses_api.texts_of_body(obj)
            elif isinstance(obj, dict):
                self.usage = usage_from(obj)
                self.texts = _choice_texts(obj)
