"""The per-stream state machine in process: messages in, answers out, nothing held after."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.breaker import BreakerState
from extproc.policy.schema import build_policy, hash_key
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime


def policy(tpm: int = 100_000) -> Any:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      # One tenant: attribution off, so its failures are the backend's (these
                      # tests are about the backend's breaker; tests/test_tenant_breaker_stream.py
                      # about who a failure is blamed on).
                      "breaker": {"consecutive_failures": 1, "cooldown_s": 1, "max_cooldown_s": 2,
                                  "min_failing_tenants": 1},
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": tpm, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def headers(**h: str) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k.replace("_", "-") if not k.startswith("_") else
                                                          ":" + k[1:], raw_value=v.encode()) for k, v in h.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm))


def body(max_tokens: int) -> pb.ProcessingRequest:
    raw = json.dumps({"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))


def response(status: int) -> pb.ProcessingRequest:
    raw = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}).encode()
    r = pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=True))
    r.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = status
    return r


async def exchange(rt: Runtime, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]  # no queueing in these tests
    out = []
    for m in messages:
        phase = m.WhichOneof("request")
        if phase == "request_body":
            out += [r async for r in sp.handle_body(m)]
        elif (r := sp.handle(phase, m)) is not None:
            out.append(r)
        if sp.finished:
            break
    sp.settle("disconnect")
    return out


def test_a_request_refused_after_winning_the_half_open_probe_gives_the_probe_back() -> None:
    clock = Clock()
    rt = Runtime(policy(tpm=100), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")
    # One 500 trips the breaker; after the cooldown it lets a single probe through.
    asyncio.run(exchange(rt, hdr, body(10), response(500)))
    assert be.breaker.state(clock.now) is BreakerState.OPEN
    clock.now += 1.5
    # This request wins the probe, then is refused for tokens (it needs more than 100).
    out = asyncio.run(exchange(rt, hdr, body(500)))
    assert out[-1].immediate_response.status.code == 429
    # The probe's place is free again: the next request may probe.
    out = asyncio.run(exchange(rt, hdr, body(10), response(200)))
    assert not out[-1].HasField("immediate_response")
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]
    rt.close()


def test_passthrough_path_is_answered_at_its_headers_and_holds_nothing() -> None:
    # Its route sends Sluice nothing more (extproc_filter.headers_only); the stream is done.
    doc_policy = policy()
    gw = doc_policy.gateway.__class__(unknown_paths="passthrough")
    rt = Runtime(doc_policy.__class__(**{**doc_policy.__dict__, "gateway": gw}))
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    out = [sp.handle("request_headers", headers(_path="/v1/files", _method="GET", authorization="Bearer k"))]
    assert sp.finished and out[0] is not None and out[0].HasField("request_headers")
    set_headers = {
        h.header.key: h.header.raw_value for h in out[0].request_headers.response.header_mutation.set_headers
    }
    assert set_headers["x-sluice-tenant"] == b"a"
    assert "authorization" in out[0].request_headers.response.header_mutation.remove_headers
    assert rt.status()["in_flight"] == 0
    rt.close()


def test_a_model_route_breaker_trips_that_model_only() -> None:
    clock = Clock()
    p = build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      "models": [{"name": "m", "context_window": 4096,
                                  "breaker": {"consecutive_failures": 1, "cooldown_s": 5,
                                              "max_cooldown_s": 5, "min_failing_tenants": 1}},
                                 {"name": "m2", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })
    rt = Runtime(p, clock=clock)
    rt.backends["b"].has_metrics = False
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")

    def ask(model: str, status: int = 200) -> pb.ProcessingResponse:
        raw = json.dumps({"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        req = pb.ProcessingRequest(request_body=pb.HttpBody(body=raw.encode(), end_of_stream=True))
        return asyncio.run(exchange(rt, hdr, req, response(status)))[-1]

    assert not ask("m", 500).HasField("immediate_response")  # the failure that trips m's route
    refused = ask("m")
    assert refused.immediate_response.status.code == 503
    assert b"Model 'm'" in refused.immediate_response.body
    assert not ask("m2").HasField("immediate_response"), "the backend's other model is unaffected"
    assert rt.backends["b"].breaker.state(clock.now) is BreakerState.CLOSED
    assert rt.status()["backends"]["b"]["route_breakers"]["m"]["state"] == "open"
    rt.close()


def test_a_manual_override_can_target_one_model_route() -> None:
    p = build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      "models": [{"name": "m", "context_window": 4096, "breaker": {}},
                                 {"name": "m2", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
        "breakers": [{"backend": "b", "model": "m", "state": "open", "reason": "bad adapter"}],
    })
    rt = Runtime(p)
    be = rt.backends["b"]
    assert be.route_breakers["m"].state(rt.clock()) is BreakerState.OPEN
    assert be.breaker.state(rt.clock()) is BreakerState.CLOSED
    rt.close()


def immediate_headers(r: pb.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in r.immediate_response.headers.set_headers}


def test_400_and_404_rejections_carry_the_tenants_rate_limit_headers() -> None:
    rt = Runtime(policy(), clock=Clock())  # time stands still: the bucket does not refill
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")
    asyncio.run(exchange(rt, hdr, body(10), response(200)))  # spend 6 tokens first
    dup = pb.ProcessingRequest(request_body=pb.HttpBody(
        body=b'{"model":"m","max_tokens":9000,"max_tokens":4,"messages":[{"role":"user","content":"x"}]}',
        end_of_stream=True))
    cases = [
        (asyncio.run(exchange(rt, hdr, dup))[-1], 400, "bad_request"),
        (asyncio.run(exchange(rt, headers(_path="/v1/nope", _method="POST", authorization="Bearer k")))[-1],
         404, "unknown_path"),
    ]
    remaining = str(rt.state.view("a", rt.policy.limits(rt.policy.tenants["a"]), rt.clock())[0].remaining)
    for out, status, reason in cases:
        assert out.immediate_response.status.code == status
        h = immediate_headers(out)
        assert h["x-sluice-reason"] == reason
        assert h["x-ratelimit-limit-tokens"] == "100000" and h["x-ratelimit-limit-requests"] == "1000"
        assert h["x-ratelimit-remaining-tokens"] == remaining == "99994"
    err = json.loads(cases[0][0].immediate_response.body)["error"]
    assert err["param"] == "max_tokens" and "max_tokens" in err["message"]
    rt.close()


def two_model_policy() -> Any:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      "models": [{"name": "m", "context_window": 4096, "fallback_model": "org/small"},
                                 {"name": "org/small", "context_window": 2048}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


def test_models_are_listed_from_the_policy_without_a_backend() -> None:
    rt = Runtime(two_model_policy())
    hdr = headers(_path="/v1/models", _method="GET", authorization="Bearer k")
    (out,) = asyncio.run(exchange(rt, hdr))
    assert out.immediate_response.status.code == 200
    doc = json.loads(out.immediate_response.body)
    assert doc["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in doc["data"]] == [
        ("m", "model", "sluice"), ("org/small", "model", "sluice")]
    assert all(isinstance(m["created"], int) for m in doc["data"])
    h = immediate_headers(out)
    assert h["content-type"] == "application/json" and h["x-ratelimit-limit-tokens"] == "100000"
    assert "x-sluice-reason" not in h
    # One model by id (percent-encoded as the SDK sends it); an unknown one is 404 model_not_found.
    (one,) = asyncio.run(exchange(rt, headers(_path="/v1/models/org%2Fsmall", _method="GET",
                                              authorization="Bearer k")))
    assert json.loads(one.immediate_response.body)["id"] == "org/small"
    (missing,) = asyncio.run(exchange(rt, headers(_path="/v1/models/gpt-4", _method="GET", authorization="Bearer k")))
    assert missing.immediate_response.status.code == 404
    err = json.loads(missing.immediate_response.body)["error"]
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert immediate_headers(missing)["x-sluice-reason"] == "unknown_model"
    # Without a valid key: 401, and no tenant's numbers.
    (anon,) = asyncio.run(exchange(rt, headers(_path="/v1/models", _method="GET", authorization="Bearer nope")))
    assert anon.immediate_response.status.code == 401
    assert not any(k.startswith("x-ratelimit") for k in immediate_headers(anon))
    # Not a write path.
    (post,) = asyncio.run(exchange(rt, headers(_path="/v1/models", _method="POST", authorization="Bearer k")))
    assert post.immediate_response.status.code == 400
    assert rt.status()["in_flight"] == 0 and rt.status()["ledger"]["precharged"] == 0
    rt.close()


def test_a_responses_api_request_is_reserved_from_max_output_tokens_and_settled_from_its_usage() -> None:
    rt = Runtime(policy(), clock=Clock())
    hdr = headers(_path="/v1/responses", _method="POST", authorization="Bearer k")
    req = pb.ProcessingRequest(request_body=pb.HttpBody(
        body=json.dumps({"model": "m", "input": "hi", "max_output_tokens": 50}).encode(), end_of_stream=True))
    reply = pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps({
        "object": "response", "status": "completed", "output": [],
        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}).encode(), end_of_stream=True))
    reply.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    out = asyncio.run(exchange(rt, hdr, req, reply))
    assert not any(r.HasField("immediate_response") for r in out)
    assert not out[1].request_body.response.HasField("body_mutation")  # max_output_tokens as asked
    ledger = rt.status()["ledger"]
    assert ledger["precharged"] == 8 + 50  # "user", "hi", 3 framing + 3 priming; 50 reserved
    assert ledger["charged"] == 13 and ledger["refunded"] == 45 and ledger["balanced"]
    rt.close()


def test_a_responses_api_prompt_over_the_window_names_input() -> None:
    rt = Runtime(policy(), clock=Clock())
    hdr = headers(_path="/v1/responses", _method="POST", authorization="Bearer k")
    req = pb.ProcessingRequest(request_body=pb.HttpBody(
        body=json.dumps({"model": "m", "input": "hi", "max_output_tokens": 5000}).encode(), end_of_stream=True))
    out = asyncio.run(exchange(rt, hdr, req))[-1]
    assert out.immediate_response.status.code == 400
    err = json.loads(out.immediate_response.body)["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "input")
    # A refused prompt pays for its counting (the prompt's tokens, spent), and holds nothing.
    ledger = rt.status()["ledger"]
    assert ledger["outstanding"] == 0 and ledger["balanced"], ledger
    assert ledger["charged"] == ledger["precharged"] > 0, ledger
    rt.close()


# -- response_processing usage_trailers: response headers, then Envoy's usage in the trailers --


def response_headers(status: int, ctype: str = "text/event-stream") -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                                     base_pb2.HeaderValue(key="content-type", raw_value=ctype.encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))


def trailers(input_tokens: int | None, output_tokens: int | None) -> pb.ProcessingRequest:
    from extproc.envoy import usage_record

    req = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    u = usage_record.TokenUsage()
    if input_tokens is not None:
        u.input_tokens.value = input_tokens
    if output_tokens is not None:
        u.output_tokens.value = output_tokens
    packed = req.metadata_context.typed_filter_metadata[usage_record.USAGE_NAMESPACE]
    packed.type_url, packed.value = "type.googleapis.com/" + usage_record.TOKEN_USAGE, u.SerializeToString()
    return req


def stream_body(max_tokens: int, usage: bool = False) -> pb.ProcessingRequest:
    doc: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}
    if usage:
        doc["stream_options"] = {"include_usage": True}
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(doc).encode(), end_of_stream=True))


def test_usage_trailers_settle_from_envoys_record_and_learn_the_rate() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    assert sp.handle("request_headers", hdr) is not None
    (answer,) = asyncio.run(_body(sp))
    meta = answer.dynamic_metadata.fields["sluice"].struct_value.fields
    assert meta["hide_usage"].string_value == "1"  # the client did not ask: Envoy's Lua drops the chunk
    sp.handle("response_headers", response_headers(200))
    clock.now += 2.0
    assert sp.handle("response_trailers", trailers(9, 40)).HasField("response_trailers")
    assert sp.settled
    assert rt.state.snapshot(clock.now)["ledger"]["charged"] == 49
    assert rt.decode_rates.rate("m") == 20.0  # 40 tokens in 2 s
    rt.close()


async def _body(sp: StreamProcessor) -> list[pb.ProcessingResponse]:
    return [r async for r in sp.handle_body(stream_body(100))]


def test_usage_trailers_error_status_settles_at_the_headers_unbilled_and_tells_the_breaker() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    be = rt.backends["b"]
    be.has_metrics = False
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    sp.handle("request_headers", hdr)
    asyncio.run(_body(sp))
    sp.handle("response_headers", response_headers(500, "application/json"))
    assert sp.settled, "no trailers come for an error response"
    assert rt.state.snapshot(clock.now)["ledger"]["charged"] == 0
    assert be.breaker.state(clock.now) is BreakerState.OPEN  # consecutive_failures: 1
    rt.close()


def test_usage_trailers_without_a_record_estimate_from_the_learned_rate() -> None:
    clock = Clock()
    rt = Runtime(policy(), clock=clock)
    rt.backends["b"].has_metrics = False
    rt.decode_rates.observe("m", 100, 1, 2.0)  # 50 tok/s
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    sp.handle("request_headers", hdr)
    asyncio.run(_body(sp))
    sp.handle("response_headers", response_headers(200))
    clock.now += 0.5
    sp.settle("disconnect")  # the client left: no trailers
    assert rt.state.snapshot(clock.now)["ledger"]["charged"] == sp.settlement.prompt_tokens + 25
    rt.close()


def test_a_responses_api_body_is_read_by_sluice_and_may_end_with_the_usage_filters_trailers() -> None:
    # Envoy's usage filter reads chat completions only: a Responses API request's route
    # streams its response body to Sluice (extproc_filter.reads_response_body), and the
    # filter's trailers end that body.
    rt = Runtime(policy(), clock=Clock())
    rt.backends["b"].has_metrics = False
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    sp.handle("request_headers", headers(_path="/v1/responses", _method="POST", authorization="Bearer k"))
    body = pb.ProcessingRequest(request_body=pb.HttpBody(
        body=json.dumps({"model": "m", "input": "hi", "max_output_tokens": 50}).encode(), end_of_stream=True))

    async def admit() -> list[pb.ProcessingResponse]:
        return [r async for r in sp.handle_body(body)]

    asyncio.run(admit())
    sp.handle("response_headers", response_headers(200, "application/json"))
    reply = json.dumps({"object": "response", "status": "completed", "output": [],
                        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}).encode()
    sp.handle("response_body", pb.ProcessingRequest(response_body=pb.HttpBody(body=reply)))
    assert not sp.settled
    sp.handle("response_trailers", pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert sp.settled
    ledger = rt.status()["ledger"]
    assert ledger["charged"] == 13 and ledger["outstanding"] == 0 and ledger["balanced"], ledger
    rt.close()


def test_an_admitted_requests_response_side_is_turned_on_by_sluices_answer_to_its_headers() -> None:
    """The filter's static mode leaves the response side off (a reply Envoy makes for a
    request ext_proc never saw costs no round trip); the route a request matches turns it
    on (Envoy 1.40 ignores a mode_override with the one-round-trip request side), and the
    answer to the request headers says the same mode for a filter that takes one."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    from extproc.wire.messages import RESPONSE_MODES

    pm = processing_mode_pb2.ProcessingMode
    for processing, response_headers in (("usage_trailers", pm.SEND), ("streamed", pm.SKIP),
                                         ("access_log", pm.SKIP)):
        base = policy()
        rt = Runtime(base.__class__(**{**base.__dict__, "gateway": base.gateway.__class__(
            response_processing=processing)}))
        sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
        answer = sp.handle("request_headers", headers(_path="/v1/chat/completions", _method="POST",
                                                      authorization="Bearer k"))
        assert answer is not None and answer.mode_override == RESPONSE_MODES[processing]
        assert answer.mode_override.response_header_mode == response_headers
        assert answer.mode_override.request_body_mode == pm.STREAMED  # the request side stays
        rt.close()
