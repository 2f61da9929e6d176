"""Request-body parsing: validation errors, prompt accounting, the upstream rewrite."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.openai_api.body import (
    MAX_N,
    REPLY_PRIMING,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    BadRequest,
    ParsedRequest,
    parse_request,
    path_kind,
    upstream_body,
)


def raw(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def bad(kind: str, body: bytes | dict[str, Any]) -> BadRequest:
    data = body if isinstance(body, bytes) else raw(body)
    with pytest.raises(BadRequest) as ei:
        parse_request(kind, data)
    return ei.value


# -- paths ------------------------------------------------------------------

def test_path_kind() -> None:
    assert path_kind("/v1/chat/completions") == "chat"
    assert path_kind("/v1/completions?x=1") == "completions"
    assert path_kind("/v1/embeddings") == "embeddings"
    assert path_kind("/v1/models") is None


# -- valid bodies -------------------------------------------------------------

def test_valid_chat() -> None:
    req = parse_request("chat", raw(chat(max_tokens=50, n=2, stream=True)))
    assert req.kind == "chat" and req.model == "m"
    assert req.stream is True and req.usage_requested is False
    assert req.n == 2 and req.max_tokens == 50
    assert req.texts == ["user", "hi"]
    assert req.fixed_tokens == TOKENS_PER_MESSAGE + REPLY_PRIMING


def test_valid_completions_and_embeddings() -> None:
    req = parse_request("completions", raw({"model": "m", "prompt": "once upon"}))
    assert (req.texts, req.n, req.max_tokens, req.stream) == (["once upon"], 1, None, False)
    emb = parse_request("embeddings", raw({"model": "e", "input": ["a", "b"]}))
    assert emb.texts == ["a", "b"] and emb.n == 0


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_request("chat", raw(chat(max_tokens=500, max_completion_tokens=20)))
    assert req.max_tokens == 20


def test_stream_options_include_usage() -> None:
    req = parse_request("chat", raw(chat(stream=True, stream_options={"include_usage": True})))
    assert req.usage_requested is True
    req = parse_request("chat", raw(chat(stream=True, stream_options=None, n=None, max_tokens=None)))
    assert (req.usage_requested, req.n, req.max_tokens) == (False, 1, None)


# -- error paths: param and code ------------------------------------------------

@pytest.mark.parametrize(
    "body, code",
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"model": "m", "prompt": "x"', "invalid_json"),
        (b"\xff\xfe{}", "invalid_encoding"),
        (b'{"model": "caf\xe9"}', "invalid_encoding"),
        (b"[]", "invalid_json"),
        (b'[{"model": "m"}]', "invalid_json"),
        (b'"a string"', "invalid_json"),
        (b"null", "invalid_json"),
        (b'{"model":"m","prompt":"x","temperature":NaN}', "invalid_json"),
        (b'{"model":"m","prompt":"x","temperature":Infinity}', "invalid_json"),
        (b'{"model":"m","prompt":"x","temperature":-Infinity}', "invalid_json"),
        (b'{"model":"m","prompt":"x","temperature":1e400}', "invalid_json"),
        (b'{"model":"m","prompt":"x","seed":' + b"9" * 5000 + b"}", "invalid_json"),
    ],
)
def test_undecodable_bodies(body: bytes, code: str) -> None:
    err = bad("completions", body)
    assert err.code == code and err.param is None
    assert err.message


def test_utf8_error_names_the_byte() -> None:
    err = bad("chat", b'{"model": "\xc3"}')
    assert "byte 11" in err.message


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_is_a_bad_request(depth: int) -> None:
    err = bad("chat", b"[" * depth + b"]" * depth)
    assert err.code == "invalid_json"
    inner = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
    assert bad("chat", inner).code == "invalid_json"
    nested_obj = b'{"a":' * depth + b"1" + b"}" * depth
    assert bad("chat", nested_obj).code == "invalid_json"


@pytest.mark.parametrize("kind", ["chat", "completions", "embeddings"])
def test_model_required_and_typed(kind: str) -> None:
    err = bad(kind, {"messages": [], "prompt": "x", "input": "x"})
    assert (err.param, err.code) == ("model", "missing_field")
    for wrong in ("", 5, ["m"], True):
        err = bad(kind, {"model": wrong, "prompt": "x", "input": "x"})
        assert (err.param, err.code) == ("model", "invalid_type")


@pytest.mark.parametrize(
    "kind, body, param, code",
    [
        ("chat", {"model": "m"}, "messages", "missing_field"),
        ("chat", {"model": "m", "messages": None}, "messages", "missing_field"),
        ("chat", {"model": "m", "messages": []}, "messages", "invalid_type"),
        ("chat", {"model": "m", "messages": "hi"}, "messages", "invalid_type"),
        ("chat", {"model": "m", "messages": {"role": "user"}}, "messages", "invalid_type"),
        ("chat", {"model": "m", "messages": ["hi"]}, "messages[0]", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": 1, "content": "x"}]}, "messages[0].role",
         "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"},
                                             {"role": "user", "content": 5}]},
         "messages[1].content", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": {"text": "x"}}]},
         "messages[0].content", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": ["x"]}]},
         "messages[0].content[0]", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
         "messages[0].content[0]", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages[0].content[0].text", "invalid_type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "name": 7}]},
         "messages[0].name", "invalid_type"),
        ("completions", {"model": "m"}, "prompt", "missing_field"),
        ("completions", {"model": "m", "prompt": None}, "prompt", "invalid_type"),
        ("completions", {"model": "m", "prompt": []}, "prompt", "invalid_type"),
        ("completions", {"model": "m", "prompt": 5}, "prompt", "invalid_type"),
        ("completions", {"model": "m", "prompt": ["a", 5]}, "prompt[1]", "invalid_type"),
        ("completions", {"model": "m", "prompt": ["a", [1, "x"]]}, "prompt[1]", "invalid_type"),
        ("completions", {"model": "m", "prompt": [True, False]}, "prompt[0]", "invalid_type"),
        ("embeddings", {"model": "m"}, "input", "missing_field"),
        ("embeddings", {"model": "m", "input": {"a": 1}}, "input", "invalid_type"),
        ("embeddings", {"model": "m", "input": [None]}, "input[0]", "invalid_type"),
    ],
)
def test_field_errors(kind: str, body: dict[str, Any], param: str, code: str) -> None:
    err = bad(kind, body)
    assert (err.param, err.code) == (param, code)
    assert param.split("[")[0].split(".")[0] in err.message


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "n"])
@pytest.mark.parametrize("value", ["10", 1.5, True, False, [1], {"a": 1}])
def test_integer_fields_reject_other_types(key: str, value: Any) -> None:
    for kind, base in (("chat", chat()), ("completions", {"model": "m", "prompt": "x"})):
        err = bad(kind, {**base, key: value})
        assert (err.param, err.code) == (key, "invalid_type")


@pytest.mark.parametrize("key, value", [("max_tokens", 0), ("max_tokens", -1),
                                        ("max_completion_tokens", 0), ("n", 0), ("n", MAX_N + 1)])
def test_integer_fields_range(key: str, value: int) -> None:
    err = bad("chat", chat(**{key: value}))
    assert (err.param, err.code) == (key, "invalid_value")


def test_best_of_is_checked_for_completions() -> None:
    err = bad("completions", {"model": "m", "prompt": "x", "best_of": True})
    assert (err.param, err.code) == ("best_of", "invalid_type")


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_stream_must_be_boolean(value: Any) -> None:
    err = bad("chat", chat(stream=value))
    assert (err.param, err.code) == ("stream", "invalid_type")


@pytest.mark.parametrize("value", ["yes", True, [1], 3])
def test_stream_options_must_be_object(value: Any) -> None:
    err = bad("chat", chat(stream=True, stream_options=value))
    assert (err.param, err.code) == ("stream_options", "invalid_type")


def test_include_usage_must_be_boolean() -> None:
    err = bad("chat", chat(stream=True, stream_options={"include_usage": 1}))
    assert (err.param, err.code) == ("stream_options.include_usage", "invalid_type")


# -- prompt accounting ----------------------------------------------------------

def test_token_id_prompts_are_fixed_tokens() -> None:
    req = parse_request("completions", raw({"model": "m", "prompt": [1, 2, 3, 4]}))
    assert (req.fixed_tokens, req.texts, req.n) == (4, [], 1)
    req = parse_request("completions", raw({"model": "m", "prompt": [[1, 2], "text", [3]], "n": 2}))
    assert (req.fixed_tokens, req.texts, req.n) == (3, ["text"], 6)
    emb = parse_request("embeddings", raw({"model": "m", "input": [[5, 6, 7]]}))
    assert emb.fixed_tokens == 3 and emb.n == 0


def test_n_times_prompts_and_best_of() -> None:
    req = parse_request("completions", raw({"model": "m", "prompt": ["a", "b", "c"], "n": 2}))
    assert req.n == 6
    req = parse_request("completions", raw({"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 5}))
    assert req.n == 10
    req = parse_request("chat", raw(chat(n=4)))
    assert req.n == 4


def test_chat_overhead() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    req = parse_request("chat", raw({"model": "m", "messages": msgs}))
    assert req.fixed_tokens == 3 * TOKENS_PER_MESSAGE + REPLY_PRIMING + 2 * TOKENS_PER_NAME
    assert req.fixed_tokens == 3 * 3 + 3 + 2
    assert req.texts == ["system", "be brief", "user", "hi", "alice", "assistant", "bot"]


def test_image_parts_add_the_estimate() -> None:
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_image", "image_url": "https://x/y.png"},
    ]
    body = raw({"model": "m", "messages": [{"role": "user", "content": content}]})
    req = parse_request("chat", body, image_tokens=100)
    assert req.fixed_tokens == TOKENS_PER_MESSAGE + REPLY_PRIMING + 2 * 100
    assert req.texts == ["user", "what is this?"]
    assert not any("base64" in t for t in req.texts)
    default = parse_request("chat", body)
    assert default.fixed_tokens - req.fixed_tokens == 2 * (765 - 100)


def test_tools_and_other_parts_are_prompt_text() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    msgs = [{"role": "user", "content": [{"type": "input_audio", "data": "zz"}]},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "lookup"}}]}]
    req = parse_request("chat", raw({"model": "m", "messages": msgs, "tools": tools}))
    joined = " ".join(req.texts)
    assert "input_audio" in joined and "c1" in joined and "lookup" in joined
    assert json.loads(req.texts[-1]) == tools


def test_text_bytes() -> None:
    req = ParsedRequest(kind="chat", model="m", body={}, texts=["ab", "cde"])
    assert req.text_bytes() == 5


# -- upstream body -------------------------------------------------------------

def test_upstream_unchanged_returns_none() -> None:
    req = parse_request("chat", raw(chat(max_tokens=100)))
    assert upstream_body(req, 100) is None
    stream = parse_request("chat", raw(chat(max_tokens=100, stream=True,
                                            stream_options={"include_usage": True})))
    assert upstream_body(stream, 100) is None
    emb = parse_request("embeddings", raw({"model": "m", "input": "x"}))
    assert upstream_body(emb, 100) is None


def test_upstream_injects_max_tokens() -> None:
    req = parse_request("chat", raw(chat(temperature=0.2)))
    out = upstream_body(req, 256)
    assert out is not None
    body = json.loads(out)
    assert body["max_tokens"] == 256
    assert "max_completion_tokens" not in body
    assert body["temperature"] == 0.2 and body["messages"] == chat()["messages"]


def test_upstream_rewrites_larger_max_tokens() -> None:
    req = parse_request("completions", raw({"model": "m", "prompt": "x", "max_tokens": 9000}))
    out = upstream_body(req, 1000)
    assert out is not None and json.loads(out)["max_tokens"] == 1000


def test_upstream_rewrites_max_completion_tokens() -> None:
    req = parse_request("chat", raw(chat(max_completion_tokens=9000)))
    body = json.loads(upstream_body(req, 1000) or b"")
    assert body["max_completion_tokens"] == 1000 and "max_tokens" not in body
    both = parse_request("chat", raw(chat(max_completion_tokens=9000, max_tokens=8000)))
    body = json.loads(upstream_body(both, 1000) or b"")
    assert body["max_completion_tokens"] == 1000 and body["max_tokens"] == 1000


def test_upstream_adds_include_usage_only_when_not_asked() -> None:
    req = parse_request("chat", raw(chat(max_tokens=10, stream=True)))
    body = json.loads(upstream_body(req, 10) or b"")
    assert body["stream_options"] == {"include_usage": True}
    kept = parse_request("chat", raw(chat(max_tokens=10, stream=True,
                                          stream_options={"continuous_usage_stats": False})))
    body = json.loads(upstream_body(kept, 10) or b"")
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    explicit_false = parse_request("chat", raw(chat(max_tokens=10, stream=True,
                                                    stream_options={"include_usage": False})))
    body = json.loads(upstream_body(explicit_false, 10) or b"")
    assert body["stream_options"]["include_usage"] is True
    not_stream = parse_request("chat", raw(chat(max_tokens=10)))
    assert upstream_body(not_stream, 10) is None
    not_stream2 = parse_request("chat", raw(chat(max_tokens=10, stream=False)))
    assert upstream_body(not_stream2, 20) is not None
    assert "stream_options" not in json.loads(upstream_body(not_stream2, 20) or b"")


def test_upstream_keeps_fields_and_non_ascii() -> None:
    original = {
        "model": "m",
        "messages": [{"role": "user", "content": "Grüße, 世界 🌍 — \"quoted\" \\ back"}],
        "temperature": 0.7,
        "top_p": 0.1,
        "seed": 12345678901234567890,
        "logit_bias": {"50256": -100},
        "user": "ü",
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    req = parse_request("chat", raw(original))
    out = upstream_body(req, 64)
    assert out is not None
    text = out.decode("utf-8")
    assert "世界 🌍" in text and "\\u" not in text  # not escaped to ASCII
    body = json.loads(out)
    assert body == {**original, "max_tokens": 64}


def test_upstream_lone_surrogate_stays_valid_json() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"a\\ud800b \xc3\xa9"}]}'
    req = parse_request("chat", body)
    out = upstream_body(req, 5)
    assert out is not None
    out.decode("utf-8")  # sendable bytes
    again = json.loads(out)
    assert again["messages"][0]["content"] == "a\ud800b é"
    assert again["max_tokens"] == 5


def test_upstream_roundtrip_valid_json_with_floats_and_big_ints() -> None:
    body = b'{"model":"m","prompt":"x","temperature":1e-7,"presence_penalty":-0.0,"seed":' \
           + b"9" * 100 + b"}"
    req = parse_request("completions", body)
    out = upstream_body(req, 7)
    assert out is not None
    again = json.loads(out)
    assert again["temperature"] == 1e-7 and again["seed"] == int("9" * 100)
    assert b"NaN" not in out and b"Infinity" not in out


# -- duplicate keys ----------------------------------------------------------------

@pytest.mark.parametrize("body, key", [
    (b'{"model":"m","max_tokens":9000,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}', "max_tokens"),
    (b'{"model":"m","messages":[{"role":"user","content":"a","content":"b"}]}', "content"),
    (b'{"model":"m","messages":[{"role":"user","content":"x"}],"metadata":{"a":[{"k":1,"k":2}]}}', "k"),
])
def test_duplicate_keys_at_any_depth_are_refused_by_name(body: bytes, key: str) -> None:
    err = bad("chat", body)
    assert (err.param, err.code) == (key, "duplicate_key")
    assert repr(key) in err.message


def test_repeated_keys_in_different_objects_are_fine() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}'
    assert parse_request("chat", body).texts == ["user", "a", "user", "b"]


# -- stream_options without streaming ----------------------------------------------

@pytest.mark.parametrize("kind, extra", [("chat", chat()), ("completions", {"model": "m", "prompt": "x"})])
def test_stream_options_need_stream(kind: str, extra: dict[str, Any]) -> None:
    for stream in (False, None):
        err = bad(kind, {**extra, "stream": stream, "stream_options": {"include_usage": True}})
        assert (err.param, err.code) == ("stream_options", "invalid_value")
        assert "only allowed when 'stream' is enabled" in err.message
    err = bad(kind, {**extra, "stream_options": {"include_usage": True}})  # stream absent
    assert err.param == "stream_options"
    assert parse_request(kind, raw({**extra, "stream_options": None})).usage_requested is False


# -- the Responses API -------------------------------------------------------------

def test_path_kind_responses() -> None:
    assert path_kind("/v1/responses") == "responses"
    assert path_kind("/v1/responses/resp_1") is None  # retrieval/cancel: not generation


def test_responses_string_input_and_instructions() -> None:
    req = parse_request("responses", raw({"model": "m", "input": "hello", "instructions": "be brief",
                                          "max_output_tokens": 40, "stream": True}))
    assert (req.kind, req.n, req.max_tokens, req.stream) == ("responses", 1, 40, True)
    assert req.texts == ["system", "be brief", "user", "hello"]
    assert req.fixed_tokens == 2 * TOKENS_PER_MESSAGE + REPLY_PRIMING
    assert req.usage_requested is False


def test_responses_item_list_counts_every_part() -> None:
    body = {"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "data:x"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ], "tools": [{"type": "function", "name": "f"}]}
    req = parse_request("responses", raw(body), image_tokens=100)
    assert req.texts[:7] == ["developer", "rules", "user", "look", "assistant", "ok", "f"]
    assert req.texts[7:9] == ["{\"a\":1}", "42"]
    assert "function" in req.texts[-1]  # the tool definitions
    assert req.fixed_tokens == 5 * TOKENS_PER_MESSAGE + REPLY_PRIMING + 100
    assert req.max_tokens is None


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "input", "missing_field"),
    ({"model": "m", "input": []}, "input", "invalid_type"),
    ({"model": "m", "input": 5}, "input", "invalid_type"),
    ({"model": "m", "input": ["x"]}, "input[0]", "invalid_type"),
    ({"model": "m", "input": [{"content": "x"}]}, "input[0].role", "invalid_type"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "invalid_type"),
    ({"model": "m", "input": "x", "instructions": 3}, "instructions", "invalid_type"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"model": "m", "input": "x", "background": True}, "background", "unsupported_value"),
])
def test_responses_invalid(body: dict[str, Any], param: str, code: str) -> None:
    err = bad("responses", body)
    assert (err.param, err.code) == (param, code)


def test_upstream_responses_gets_max_output_tokens_and_no_stream_options() -> None:
    req = parse_request("responses", raw({"model": "m", "input": "x", "stream": True}))
    body = json.loads(upstream_body(req, 128) or b"")
    assert body["max_output_tokens"] == 128
    assert "stream_options" not in body and "max_tokens" not in body
    asked = parse_request("responses", raw({"model": "m", "input": "x", "max_output_tokens": 50}))
    assert upstream_body(asked, 50) is None
    assert json.loads(upstream_body(asked, 20) or b"")["max_output_tokens"] == 20  # clamped


def test_embeddings_inputs_keep_their_places_for_the_per_input_window_check() -> None:
    emb = parse_request("embeddings", raw({"model": "m", "input": ["a", [1, 2, 3], "b", [4]]}))
    assert emb.texts == ["a", "b"] and emb.text_inputs == [0, 2]
    assert emb.id_inputs == [(1, 3), (3, 1)] and emb.fixed_tokens == 4
    one = parse_request("embeddings", raw({"model": "m", "input": [9, 9]}))
    assert one.id_inputs == [(0, 2)] and one.text_inputs == []


def test_upstream_writes_the_engine_priority_over_the_clients() -> None:
    plain = parse_request("chat", raw(chat(max_tokens=100)))
    out = upstream_body(plain, 100, priority=-100)
    assert out is not None and json.loads(out)["priority"] == -100
    cheeky = parse_request("chat", raw(chat(max_tokens=100, priority=-(10**6))))
    out = upstream_body(cheeky, 100, priority=0)
    assert (
        out is not None and json.loads(out)["priority"] == 0
    )  # the client's own value never reaches the engine
    same = parse_request("chat", raw(chat(max_tokens=100, priority=-100)))
    assert upstream_body(same, 100, priority=-100) is None
    assert upstream_body(cheeky, 100) is None  # engine_priority off: the body goes as sent
