"""The Responses API (``POST /v1/responses``): what Sluice reads from its requests and replies.

Pure functions, in the Responses API's own vocabulary (``input``, ``instructions``,
``max_output_tokens``; ``usage.input_tokens``/``output_tokens``), so any response path
(the SSE and JSON trackers today) can call them:

- ``prompt_parts(body, image_tokens)``: the texts to tokenize and the tokens counted
  without tokenizing, with the same per-message framing as chat (``instructions`` is
  one more message, as vLLM renders it through the chat template).
- ``usage_of_body(obj)``: usage of a non-streaming reply (``{"object": "response", "usage": …}``).
- ``usage_of_event(obj)``: usage of a streamed event; only the final ``response.completed``
  (or ``response.incomplete`` / ``response.failed``) carries it, under ``response.usage``.
- ``texts_of_body`` / ``texts_of_event``: the generated text, counted when no usage arrives.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

# The same framing OpenAI's cookbook counts for chat messages (see openai_body).
TOKENS_PER_MESSAGE = 3
REPLY_PRIMING = 3
# Events whose ``response`` object is final and carries ``usage``.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class InvalidInput(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ResponsesUsage(NamedTuple):
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # input_tokens_details.cached_tokens, where the engine reports it


class PromptParts(NamedTuple):
    texts: list[str]
    fixed_tokens: int


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _content(content: Any, param: str, texts: list[str], image_tokens: int) -> int:
    """A message's content: a string or a list of parts; returns fixed tokens."""
    if isinstance(content, str):
        texts.append(content)
        return 0
    if not isinstance(content, list):
        raise InvalidInput(f"'{param}' must be a string or an array of content parts", param)
    fixed = 0
    for j, part in enumerate(content):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidInput(f"'{pp}' must be an object with a 'type'", pp)
        ptype = part["type"]
        if ptype in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise InvalidInput(f"'{pp}.text' must be a string", f"{pp}.text")
            texts.append(part["text"])
        elif ptype == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif ptype in ("input_image", "image_url"):
            fixed += image_tokens
        else:  # files, audio and what comes next: their JSON is an upper bound of sorts
            texts.append(_dump(part))
    return fixed


def _item(item: Any, param: str, texts: list[str], image_tokens: int) -> int:
    if not isinstance(item, dict):
        raise InvalidInput(f"'{param}' must be an object", param)
    itype = item.get("type") or "message"
    if itype == "message":
        role = item.get("role")
        if not isinstance(role, str):
            raise InvalidInput(f"'{param}.role' is required and must be a string", f"{param}.role")
        texts.append(role)
        return TOKENS_PER_MESSAGE + _content(item.get("content"), f"{param}.content", texts, image_tokens)
    if itype == "function_call":
        for key in ("name", "arguments"):
            if isinstance(item.get(key), str):
                texts.append(item[key])
        return TOKENS_PER_MESSAGE
    if itype == "function_call_output":
        out = item.get("output")
        if isinstance(out, str):
            texts.append(out)
            return TOKENS_PER_MESSAGE
        if isinstance(out, list):
            return TOKENS_PER_MESSAGE + _content(out, f"{param}.output", texts, image_tokens)
    # Reasoning items, tool calls of other kinds, item references: count their JSON.
    texts.append(_dump(item))
    return TOKENS_PER_MESSAGE


def prompt_parts(body: dict[str, Any], image_tokens: int) -> PromptParts:
    """What the backend will see as its prompt, ready for the tokenizer."""
    if "input" not in body or body["input"] is None:
        raise InvalidInput("'input' is a required property", "input")
    texts: list[str] = []
    fixed = REPLY_PRIMING
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidInput("'instructions' must be a string", "instructions")
        texts += ["system", instructions]
        fixed += TOKENS_PER_MESSAGE
    value = body["input"]
    if isinstance(value, str):
        texts += ["user", value]
        fixed += TOKENS_PER_MESSAGE
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            fixed += _item(item, f"input[{i}]", texts, image_tokens)
    else:
        raise InvalidInput("'input' must be a string or a non-empty array of input items", "input")
    # Tool definitions and the output format are part of the prompt the model sees.
    if body.get("tools"):
        texts.append(_dump(body["tools"]))
    text_cfg = body.get("text")
    if isinstance(text_cfg, dict) and isinstance(text_cfg.get("format"), dict):
        texts.append(_dump(text_cfg["format"]))
    return PromptParts(texts, fixed)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _usage(u: Any) -> ResponsesUsage | None:
    if not isinstance(u, dict):
        return None
    i, o = u.get("input_tokens"), u.get("output_tokens", 0)
    if not _count(i) or not _count(o):
        return None
    total = u.get("total_tokens")
    if o == 0 and _count(total) and total > i:
        o = total - i
    details = u.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return ResponsesUsage(i, o, min(cached, i) if _count(cached) else 0)


def usage_of_body(obj: Any) -> ResponsesUsage | None:
    return _usage(obj.get("usage")) if isinstance(obj, dict) else None


def usage_of_event(obj: Any) -> ResponsesUsage | None:
    if not isinstance(obj, dict) or obj.get("type") not in FINAL_EVENTS:
        return None
    return usage_of_body(obj.get("response"))


def texts_of_body(obj: Any) -> list[str]:
    out: list[str] = []
    items = obj.get("output") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        return out
    for item in items:
        if not isinstance(item, dict):
            continue
        for key in ("content", "summary"):
            parts = item.get(key)
            if isinstance(parts, list):
                out += [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if isinstance(item.get("arguments"), str):
            out.append(item["arguments"])
    return out


def texts_of_event(obj: Any) -> list[str]:
    # Only deltas: the ".done" events repeat what the deltas already said.
    if isinstance(obj, dict) and isinstance(obj.get("type"), str) and obj["type"].endswith(".delta"):
        d = obj.get("delta")
        if isinstance(d, str):
            return [d]
    return []
