"""The picker's tracker reads only what may hold the usage: the same usage, the same dropped
chunk and the same bytes out as SSETracker, with the other events counted instead of read."""

from __future__ import annotations

import json

from extproc.openai_api.usage import SSETracker, Usage, UsageOnlyTracker


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CONTENT = [event({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}], "usage": None}) for i in range(5)]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}})
DONE = b"data: [DONE]\n\n"


def run(tracker: SSETracker, chunks: list[bytes]) -> bytes:
    out = b""
    for i, c in enumerate(chunks):
        got = tracker.feed(c, i == len(chunks) - 1)
        out += c if got is None else got
    return out


def cases() -> list[list[bytes]]:
    whole = b"".join([*CONTENT, USAGE, DONE])
    return [
        [*CONTENT, USAGE, DONE],  # one event per chunk, as vLLM writes them
        [CONTENT[0] + CONTENT[1], *CONTENT[2:], USAGE + DONE],  # several per chunk
        [whole[:37], whole[37:150], whole[150:]],  # events split across chunks
        [*CONTENT, USAGE[:20], USAGE[20:], DONE],  # the usage chunk itself split
    ]


def test_the_same_usage_and_bytes_as_sse_tracker() -> None:
    for chunks in cases():
        for drop in (True, False):
            full, lean = SSETracker(drop_usage_chunk=drop), UsageOnlyTracker(drop_usage_chunk=drop)
            assert run(lean, chunks) == run(full, chunks)
            assert lean.usage == full.usage == Usage(9, 5)
            assert (b'"usage": {' in run(UsageOnlyTracker(drop_usage_chunk=drop), chunks)) is not drop


def test_a_cut_stream_counts_one_token_per_event_it_did_not_read() -> None:
    lean = UsageOnlyTracker(drop_usage_chunk=True)
    for c in CONTENT[:4]:
        assert lean.feed(c, False) is None  # passed on untouched, unread
    assert lean.usage is None and lean.texts == [] and lean.uncounted == 4
