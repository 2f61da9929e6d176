"""Response watching: SSE usage extraction and usage-chunk removal, JSON bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.openai_api.usage import (
    MAX_JSON_BODY,
    TAIL_BYTES,
    JSONTracker,
    SSETracker,
    Usage,
    usage_from,
    usage_in_tail,
)


def event(obj: Any, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + sep


def delta(text: str) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


USAGE_OBJ = {"id": "c1", "object": "chat.completion.chunk", "choices": [],
             "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}}
WORDS = ["Hel", "lo, ", "wörld", " 🌍"]


def stream_parts(sep: bytes = b"\n\n") -> tuple[list[bytes], bytes]:
    """(events in order, the usage event) of a realistic OpenAI chat stream."""
    events = [b": keep-alive comment" + sep]
    events += [event(delta(w), sep) for w in WORDS]
    events.append(event({"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, sep))
    usage = event(USAGE_OBJ, sep)
    events.append(usage)
    events.append(b"data: [DONE]" + sep)
    return events, usage


def run(tracker: SSETracker, chunks: list[bytes]) -> bytes:
    """Feed chunks as Envoy would; what the client receives."""
    out = []
    for i, c in enumerate(chunks):
        r = tracker.feed(c, i == len(chunks) - 1)
        out.append(c if r is None else r)
    return b"".join(out)


# -- SSE ----------------------------------------------------------------------

def test_usage_from_final_chunk_and_dropped() -> None:
    events, usage_ev = stream_parts()
    t = SSETracker(drop_usage_chunk=True)
    outs = [t.feed(e, i == len(events) - 1) for i, e in enumerate(events)]
    assert t.usage == Usage(11, 4)
    assert t.texts == WORDS
    i = events.index(usage_ev)
    assert outs[i] == b""  # the usage-only event is removed
    assert all(o is None for j, o in enumerate(outs) if j != i)  # the rest pass untouched


def test_usage_chunk_kept_when_not_dropping() -> None:
    events, _ = stream_parts()
    t = SSETracker(drop_usage_chunk=False)
    outs = [t.feed(e, False) for e in events]
    assert outs == [None] * len(events)
    assert t.usage == Usage(11, 4) and t.usage.total == 15


def test_usage_in_chunk_with_choices_is_never_dropped() -> None:
    obj = {**delta("x"), "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    t = SSETracker(drop_usage_chunk=True)
    assert t.feed(event(obj), False) is None
    assert t.usage == Usage(2, 1) and t.texts == ["x"]


def test_whole_stream_in_one_chunk() -> None:
    events, usage_ev = stream_parts()
    stream = b"".join(events)
    t = SSETracker(drop_usage_chunk=True)
    assert t.feed(stream, True) == stream.replace(usage_ev, b"")
    t2 = SSETracker(drop_usage_chunk=False)
    assert t2.feed(stream, True) is None


def test_event_straddling_two_chunks_is_held_back() -> None:
    ev = event(delta("hello"))
    t = SSETracker(drop_usage_chunk=True)
    a, b = ev[:10], ev[10:]
    assert t.feed(a, False) == b""  # held
    assert t.feed(b, False) == ev  # re-emitted whole
    assert t.texts == ["hello"]
    assert t.feed(event(delta("next")), False) is None  # back to pass-through


def test_usage_event_straddling_three_chunks_is_dropped_whole() -> None:
    before, after = event(delta("a")), b"data: [DONE]\n\n"
    u = event(USAGE_OBJ)
    stream = before + u + after
    cut1, cut2 = len(before) + 7, len(before) + 30
    chunks = [stream[:cut1], stream[cut1:cut2], stream[cut2:]]
    t = SSETracker(drop_usage_chunk=True)
    outs = [t.feed(c, i == 2) for i, c in enumerate(chunks)]
    assert outs[0] == before
    assert outs[1] == b""
    assert outs[2] == after
    assert t.usage == Usage(11, 4)


def test_separator_split_inside_crlf() -> None:
    ev = event(delta("z"), b"\r\n\r\n")
    for cut in range(len(ev) - 4, len(ev)):
        t = SSETracker(drop_usage_chunk=True)
        assert run(t, [ev[:cut], ev[cut:], event(USAGE_OBJ, b"\r\n\r\n")]) == ev
        assert t.texts == ["z"] and t.usage == Usage(11, 4)


def test_crlf_stream() -> None:
    events, usage_ev = stream_parts(b"\r\n\r\n")
    t = SSETracker(drop_usage_chunk=True)
    assert run(t, events) == b"".join(events).replace(usage_ev, b"")
    assert t.usage == Usage(11, 4) and t.texts == WORDS


def test_done_and_non_json_lines_are_ignored() -> None:
    t = SSETracker(drop_usage_chunk=True)
    for ev in (b"data: [DONE]\n\n", b"data: not json {\n\n", b"event: ping\ndata: 42\n\n",
               b"data: \xff\xfe\n\n", b"id: 3\n\n", b"data: [1, 2]\n\n", b"data: {\"choices\": 5}\n\n",
               b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"):
        assert t.feed(ev, False) is None
    assert t.usage is None and t.texts == []


def test_multi_line_data_is_joined() -> None:
    t = SSETracker(drop_usage_chunk=True)
    ev = b'data: {"choices": [{"delta":\ndata: {"content": "joined"}}]}\n\n'
    assert t.feed(ev, False) is None
    assert t.texts == ["joined"]


def test_texts_from_all_shapes() -> None:
    t = SSETracker(drop_usage_chunk=False)
    objs = [
        delta("d"),
        {"choices": [{"text": "t"}]},
        {"choices": [{"message": {"content": "m"}}]},
        {"choices": [{"delta": {"reasoning_content": "r"}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": "call_9"}]}}]},
        {"choices": ["junk", {"delta": None}]},
    ]
    for o in objs:
        t.feed(event(o), False)
    assert t.texts[:4] == ["d", "t", "m", "r"]
    assert "call_9" in t.texts[4] and len(t.texts) == 5


def test_stream_ending_without_blank_line() -> None:
    t = SSETracker(drop_usage_chunk=True)
    first = event(delta("a"))
    last = b"data: " + json.dumps(USAGE_OBJ).encode()  # no trailing separator
    assert t.feed(first, False) is None
    assert t.feed(last[:12], False) == b""
    assert t.feed(last[12:], True) == b""  # the usage event is dropped at end of stream
    assert t.usage == Usage(11, 4)
    t2 = SSETracker(drop_usage_chunk=True)
    tail = b'data: {"choices": [{"text": "end"}]}'
    assert t2.feed(tail[:5], False) == b""
    assert t2.feed(tail[5:], True) == tail
    assert t2.texts == ["end"]


def test_empty_end_of_stream_flushes_held_bytes() -> None:
    t = SSETracker(drop_usage_chunk=True)
    partial = b'data: {"choices": [{"text": "x"}]}\n'
    assert t.feed(partial, False) == b""
    assert t.feed(b"", True) == partial
    assert t.texts == ["x"]


@st.composite
def split_stream(draw: st.DrawFn) -> tuple[list[bytes], bytes, bytes, bool]:
    sep = draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))
    events, usage_ev = stream_parts(sep)
    if draw(st.booleans()):
        events = events[:-1]  # some servers send no [DONE]
    if draw(st.booleans()):  # and some do not end with a blank line
        events[-1] = events[-1][: -len(sep)]
    stream = b"".join(events)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    without_usage = b"".join(e for e in events if not e.startswith(usage_ev[:-len(sep)]))
    return chunks, stream, without_usage, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(split_stream())
def test_any_split_reassembles_the_stream(case: tuple[list[bytes], bytes, bytes, bool]) -> None:
    chunks, stream, without_usage, drop = case
    assert len(without_usage) < len(stream)
    t = SSETracker(drop_usage_chunk=drop)
    got = run(t, chunks)
    assert got == (without_usage if drop else stream)
    assert t.usage == Usage(11, 4)
    assert t.texts == WORDS
    assert t._pending == b""


# -- JSON -------------------------------------------------------------------------

COMPLETION = {"id": "x", "object": "chat.completion",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi ✓"}}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}


def test_json_usage_over_several_chunks() -> None:
    body = json.dumps(COMPLETION, ensure_ascii=False).encode()
    t = JSONTracker()
    parts = [body[:5], body[5:40], body[40:41], body[41:]]  # splits inside a multi-byte char too
    for i, p in enumerate(parts):
        assert t.feed(p, i == len(parts) - 1) is None
        if i < len(parts) - 1:
            assert t.usage is None
    assert t.usage == Usage(9, 3)
    assert t.texts == ["Hi ✓"]
    assert len(t.body) == 0


def test_json_oversized_body_gives_no_usage_and_holds_nothing() -> None:
    t = JSONTracker()
    body = json.dumps(COMPLETION).encode()
    t.feed(body[:-1], False)
    t.feed(b" " * MAX_JSON_BODY, False)
    assert t.overflow and len(t.body) == 0
    t.feed(body[-1:], True)
    assert t.usage is None and len(t.body) == 0


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"s"',
                                  b"[" * 100_000 + b"]" * 100_000])
def test_json_invalid_gives_no_usage(body: bytes) -> None:
    t = JSONTracker()
    t.feed(body, True)
    assert t.usage is None and t.texts == []
    assert len(t.body) == 0


def test_json_empty_body() -> None:
    t = JSONTracker()
    t.feed(b"", True)
    assert t.usage is None


# -- usage_from ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": -1, "completion_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": -2},
        {"prompt_tokens": True, "completion_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": True},
        {"prompt_tokens": 1.0, "completion_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": 2.5},
        {"prompt_tokens": "1", "completion_tokens": 2},
        {"completion_tokens": 2},
        {"prompt_tokens": None},
    ],
)
def test_usage_from_rejects_bad_values(usage: dict[str, Any]) -> None:
    assert usage_from({"usage": usage}) is None


def test_usage_from_shapes() -> None:
    assert usage_from(None) is None
    assert usage_from([1]) is None
    assert usage_from({"usage": None}) is None
    assert usage_from({"usage": [1, 2]}) is None
    assert usage_from({"usage": {"prompt_tokens": 5}}) == Usage(5, 0)
    # embeddings and some servers: only total_tokens
    assert usage_from({"usage": {"prompt_tokens": 5, "total_tokens": 8}}) == Usage(5, 3)
    assert usage_from({"usage": {"prompt_tokens": 5, "total_tokens": True}}) == Usage(5, 0)
    assert usage_from({"usage": {"prompt_tokens": 0, "total_tokens": True}}) == Usage(0, 0)
    assert usage_from({"usage": {"prompt_tokens": 5, "total_tokens": 3}}) == Usage(5, 0)


# -- the Responses API ----------------------------------------------------------

def typed(etype: str, **fields: Any) -> bytes:
    return f"event: {etype}\n".encode() + event({"type": etype, **fields})


RESPONSE_USAGE = {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15,
                  "output_tokens_details": {"reasoning_tokens": 0}}


def responses_stream(final: str = "response.completed", usage: Any = RESPONSE_USAGE) -> list[bytes]:
    return [
        typed("response.created", response={"id": "r", "status": "in_progress", "usage": None}),
        typed("response.output_item.added", output_index=0, item={"type": "message", "content": []}),
        *[typed("response.output_text.delta", output_index=0, content_index=0, delta=w) for w in WORDS[:3]],
        typed("response.output_text.done", output_index=0, content_index=0, text="".join(WORDS[:3])),
        typed(final, response={"id": "r", "status": "completed", "usage": usage,
                               "output": [{"type": "message", "content": [{"type": "output_text",
                                                                           "text": "".join(WORDS[:3])}]}]}),
    ]


def test_responses_stream_usage_from_the_completed_event_and_nothing_dropped() -> None:
    chunks = responses_stream()
    t = SSETracker(drop_usage_chunk=False, responses=True)
    assert run(t, chunks) == b"".join(chunks)
    assert t.usage == Usage(12, 3)
    assert t.texts == WORDS[:3]  # deltas only, not the .done repeat
    # Split anywhere, the final event still reads whole and still reaches the client.
    whole = b"".join(chunks)
    for cut in range(0, len(whole), 37):
        t = SSETracker(drop_usage_chunk=False, responses=True)
        assert run(t, [whole[:cut], whole[cut:]]) == whole
        assert t.usage == Usage(12, 3)


def test_responses_stream_incomplete_and_missing_usage() -> None:
    t = SSETracker(drop_usage_chunk=False, responses=True)
    run(t, responses_stream("response.incomplete", {"input_tokens": 12, "output_tokens": 0, "total_tokens": 20}))
    assert t.usage == Usage(12, 8)
    t = SSETracker(drop_usage_chunk=False, responses=True)
    run(t, responses_stream(usage=None))
    assert t.usage is None and t.texts == WORDS[:3]  # settled from the counted text instead
    # Chat-shaped usage in a Responses stream is not believed, nor Responses usage in a chat stream.
    t = SSETracker(drop_usage_chunk=False, responses=True)
    run(t, [event(USAGE_OBJ)])
    assert t.usage is None
    chat_t = SSETracker(drop_usage_chunk=True)
    assert run(chat_t, responses_stream()) == b"".join(responses_stream())
    assert chat_t.usage is None


def test_responses_json_body_usage_and_text() -> None:
    body = json.dumps({"object": "response", "status": "completed", "usage": RESPONSE_USAGE, "output": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "answer"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"}]}).encode()
    t = JSONTracker(responses=True)
    t.feed(body[:10], False)
    t.feed(body[10:], True)
    assert t.usage == Usage(12, 3)
    assert t.texts == ["think", "answer", "{}"]
    bad = JSONTracker(responses=True)
    bad.feed(json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode(), True)
    assert bad.usage is None


def test_an_embeddings_body_is_read_for_its_trailing_usage_only() -> None:
    data = [{"embedding": [0.1] * 2000, "index": i} for i in range(40)]
    usage = {"prompt_tokens": 25000, "total_tokens": 25000}
    body = json.dumps({"object": "list", "data": data, "model": "m", "usage": usage}).encode()
    t = JSONTracker(tail=True)
    for i in range(0, len(body), 3000):
        t.feed(body[i:i + 3000], False)
        assert len(t.body) <= TAIL_BYTES
    t.feed(b"", True)
    assert t.usage == Usage(25000, 0) and t.ended
    cut = JSONTracker(tail=True)
    cut.feed(body[:-40], True)  # the usage object cut in the middle
    assert cut.usage is None
    tail = b'{"data": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    assert usage_in_tail(tail) == Usage(3, 2)
    assert usage_in_tail(b'{"data": []}') is None


def test_cached_prompt_tokens_are_read_where_the_engine_reports_them() -> None:
    from extproc.openai_api.usage import usage_from

    got = usage_from({"usage": {"prompt_tokens": 100, "completion_tokens": 5,
                                "prompt_tokens_details": {"cached_tokens": 64}}})
    assert got is not None and (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (100, 5, 64)
    odd = usage_from({"usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                "prompt_tokens_details": {"cached_tokens": 640}}})
    assert odd is not None and odd.cached_tokens == 10, "never more than the prompt"
    assert usage_from({"usage": {"prompt_tokens": 10, "completion_tokens": 5}}).cached_tokens == 0  # type: ignore[union-attr]
    none = usage_from({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": True}}})
    assert none is not None and none.cached_tokens == 0
