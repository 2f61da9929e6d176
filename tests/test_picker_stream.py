"""Picker mode in process: a gateway's messages in (its processing modes, its metadata), the
answers out in the order Envoy requires, the request settled once, on a real Runtime."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.envoy import picker_protocol as pp
from extproc.policy.schema import build_policy, hash_key
from extproc.request.picker import PickerOptions
from extproc.runtime.runtime import Runtime
from extproc.service.picker_server import PickerProcessor

PM = processing_mode_pb2.ProcessingMode
ENDPOINTS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


def policy() -> Any:
    return build_policy({
        "backends": [{"name": "pool", "max_concurrency": 8,
                      "endpoints": [{"address": a, "kv_capacity_tokens": 100_000} for a in ENDPOINTS],
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


def headers(mode: int = PM.FULL_DUPLEX_STREAMED, key: str = "k", subset: list[str] | None = None,
            served: str | None = None, phase: str = "request_headers") -> pb.ProcessingRequest:
    fields = {":path": "/v1/chat/completions", ":method": "POST", "authorization": f"Bearer {key}"} \
        if phase == "request_headers" else {":status": "200", "content-type": "text/event-stream"}
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in fields.items()])
    r = pb.ProcessingRequest(**{phase: pb.HttpHeaders(headers=hm)})
    if phase == "request_headers":
        r.protocol_config.request_body_mode = mode
        r.protocol_config.response_body_mode = mode
    if subset is not None:
        lv = struct_pb2.ListValue()
        lv.extend(subset)
        r.metadata_context.filter_metadata[pp.SUBSET_NAMESPACE].fields[pp.SUBSET].list_value.CopyFrom(lv)
    if served is not None:
        r.metadata_context.filter_metadata[pp.NAMESPACE].fields[pp.SERVED].string_value = served
    return r


def body_chunks(stream: bool = True, parts: int = 2) -> list[pb.ProcessingRequest]:
    raw = json.dumps({"model": "m", "max_tokens": 50, "stream": stream,
                      "messages": [{"role": "user", "content": "hello there"}]}).encode()
    cut = len(raw) // parts
    pieces = [raw[i * cut:(i + 1) * cut] for i in range(parts - 1)] + [raw[(parts - 1) * cut:]]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == parts - 1))
            for i, p in enumerate(pieces)]


def sse(usage: bool) -> list[bytes]:
    out = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n']
    if usage:
        out.append(b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7}}\n\n')
    out.append(b"data: [DONE]\n\n")
    return out


def response_chunks(usage: bool = True) -> list[pb.ProcessingRequest]:
    chunks = sse(usage)
    return [pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
            for i, c in enumerate(chunks)]


async def feed(messages: list[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    """Envoy's side of the stream: the messages, then its end."""
    for m in messages:
        yield m


def run(rt: Runtime, messages: list[pb.ProcessingRequest], options: PickerOptions | None = None) -> list[Any]:
    async def go() -> list[Any]:
        proc = PickerProcessor(rt, options or PickerOptions())
        return [a async for a in proc.process(feed(messages), None)]  # type: ignore[arg-type]
    return [pb.ProcessingResponse.FromString(a) if isinstance(a, bytes) else a for a in asyncio.run(go())]


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def ledger(rt: Runtime) -> dict[str, Any]:
    return rt.status()["ledger"]


def test_full_duplex_defers_the_headers_answer_routes_echoes_and_settles_from_the_stream() -> None:
    rt = Runtime(policy())
    msgs = [headers(), *body_chunks(), headers(phase="response_headers"), *response_chunks(usage=True)]
    out = run(rt, msgs)
    kinds = [a.WhichOneof("response") for a in out]
    # Nothing for the headers nor the first chunk; then headers, body, response headers, 3 chunks.
    assert kinds == ["request_headers", "request_body", "response_headers", *["response_body"] * 3]
    head = out[0].request_headers.response
    dest = set_headers(head)[pp.DESTINATION]
    assert dest in ENDPOINTS and "," not in dest
    assert head.clear_route_cache
    assert out[0].dynamic_metadata.fields[pp.NAMESPACE].struct_value.fields[pp.DESTINATION].string_value == dest
    echoed = out[1].request_body.response.body_mutation.streamed_response
    assert echoed.end_of_stream
    sent = json.loads(echoed.body)
    assert sent["stream_options"] == {"include_usage": True}  # asked for, to settle exactly
    assert set_headers(head)["content-length"] == str(len(echoed.body))
    assert "x-ratelimit-limit-tokens" in set_headers(out[2].response_headers.response)
    bodies = [a.response_body.response.body_mutation.streamed_response.body for a in out[3:]]
    assert b"usage" not in b"".join(bodies)  # the client did not ask for it
    assert bodies[-1] == b"data: [DONE]\n\n"
    led = ledger(rt)
    assert led["outstanding"] == 0 and led["charged"] == 16 and led["balanced"]
    assert rt.status()["in_flight"] == 0


def test_buffered_answers_the_headers_at_once_and_routes_on_the_body() -> None:
    rt = Runtime(policy())
    msgs = [headers(mode=PM.BUFFERED), *body_chunks(parts=1)]
    out = run(rt, msgs)
    assert [a.WhichOneof("response") for a in out] == ["request_headers", "request_body"]
    assert pp.DESTINATION not in set_headers(out[0].request_headers.response)
    assert pp.DESTINATION in out[0].request_headers.response.header_mutation.remove_headers  # a client's goes
    routed = out[1].request_body.response
    assert set_headers(routed)[pp.DESTINATION] in ENDPOINTS
    assert routed.clear_route_cache and routed.body_mutation.body
    assert ledger(rt)["outstanding"] == 0  # the stream ended here: settled as a disconnect


def test_the_fallback_list_names_a_second_choice() -> None:
    out = run(Runtime(policy()), [headers(), *body_chunks()], PickerOptions(fallback_list=True))
    first, _, second = set_headers(out[0].request_headers.response)[pp.DESTINATION].partition(",")
    assert first in ENDPOINTS and second in ENDPOINTS and first != second


def test_the_subset_hint_binds_the_pick() -> None:
    for only in ENDPOINTS:
        rt = Runtime(policy())
        out = run(rt, [headers(subset=[only]), *body_chunks()])
        assert set_headers(out[0].request_headers.response)[pp.DESTINATION] == only
        pool = {e["address"]: e for e in rt.status()["backends"]["pool"]["endpoints"]}
        assert all(e["slots"]["in_use"] == 0 for e in pool.values())  # the moved hold went back too


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:80"]])
def test_a_subset_with_nothing_eligible_is_503(subset: list[str]) -> None:
    rt = Runtime(policy())
    out = run(rt, [headers(subset=subset), *body_chunks()])
    assert len(out) == 1 and out[0].immediate_response.status.code == 503
    assert {h.header.key: h.header.raw_value for h in out[0].immediate_response.headers.set_headers}[
        "x-sluice-reason"] == b"no_endpoint"
    assert ledger(rt)["outstanding"] == 0 and ledger(rt)["charged"] == 0


def test_the_served_endpoint_moves_the_hold() -> None:
    rt = Runtime(policy())
    out = run(rt, [headers(), *body_chunks(), headers(phase="response_headers")], PickerOptions())
    picked = set_headers(out[0].request_headers.response)[pp.DESTINATION]
    other = next(e for e in ENDPOINTS if e != picked)
    rt2 = Runtime(policy())
    run(rt2, [headers(), *body_chunks(), headers(phase="response_headers", served=other)])
    moved = {e["address"]: e["repicks"] for e in rt2.status()["backends"]["pool"]["endpoints"]}
    assert moved[picked] == {"away": 1, "here": 0} and moved[other] == {"away": 0, "here": 1}


def test_a_cut_before_the_response_settles_once_charging_the_prompt() -> None:
    rt = Runtime(policy())
    run(rt, [headers(), *body_chunks()])  # the stream ends with no response: the client went away
    led = ledger(rt)
    assert led["outstanding"] == 0 and led["balanced"] and led["charged"] > 0
    assert rt.status()["in_flight"] == 0


def test_unknown_key_is_refused_at_the_headers() -> None:
    rt = Runtime(policy())
    out = run(rt, [headers(key="nope"), *body_chunks()])
    assert len(out) == 1 and out[0].immediate_response.status.code == 401


@pytest.mark.parametrize("chunk,eos", [(b"data: x\n\n", False), (b"", True), (b"a" * 300, True)])
def test_echo_bytes_are_the_message_protobuf_would_write(chunk: bytes, eos: bool) -> None:
    want = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=eos)))))
    assert pp.echo(pp.RESPONSE_BODY_FIELD, chunk, eos) == want.SerializeToString()


def test_a_large_body_is_echoed_in_chunks_the_last_ending_the_stream() -> None:
    body = bytes(range(256)) * 1000  # 256,000 bytes
    parts = [pb.ProcessingResponse.FromString(b).request_body.response.body_mutation.streamed_response
             for b in pp.echo_all(pp.REQUEST_BODY_FIELD, body, True)]
    assert all(len(p.body) <= pp.MAX_CHUNK for p in parts) and b"".join(p.body for p in parts) == body
    assert [p.end_of_stream for p in parts] == [False] * (len(parts) - 1) + [True]


def test_a_chunked_upload_over_the_cap_is_refused_as_it_grows() -> None:
    rt = Runtime(policy())
    cap = rt.policy.gateway.max_body_bytes
    chunk = b"x" * (cap // 4 + 1)
    chunks = [pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)) for _ in range(10)]
    out = run(rt, [headers(), *chunks])
    assert len(out) == 1 and out[0].immediate_response.status.code == 413
    assert ledger(rt)["outstanding"] == 0 and ledger(rt)["charged"] == 0


def _chunk_message(body: bytes, eos: bool, metadata: bool) -> bytes:
    r = pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=eos))
    if metadata:
        r.metadata_context.SetInParent()  # empty, as Envoy 1.40 sends it with every message
    return r.SerializeToString()


@pytest.mark.parametrize("body", [b"", b"data: x\n\n", b"B\x00", b"x" * 20000])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("metadata", [False, True])
def test_a_streamed_chunk_is_read_from_its_bytes_as_protobuf_reads_it(body: bytes, eos: bool,
                                                                        metadata: bool) -> None:
    assert pp.response_chunk(_chunk_message(body, eos, metadata)) == (body, eos)


def test_anything_but_a_bare_chunk_is_left_to_protobuf() -> None:
    with_fields = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x"))
    with_fields.metadata_context.filter_metadata["envoy.lb"].fields["k"].string_value = "v"
    other = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x", end_of_stream=True))
    attrs = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x"), observability_mode=True)
    for m in (with_fields, other, attrs):
        assert pp.response_chunk(m.SerializeToString()) is None
    good = _chunk_message(b"data: y\n\n", False, True)
    for cut in range(1, len(good)):  # truncated or with bytes after: None, or what protobuf reads
        for data in (good[:cut], good + good[:cut]):
            got = pp.response_chunk(data)
            if got is not None:
                m = pb.ProcessingRequest.FromString(data)
                assert got == (m.response_body.body, m.response_body.end_of_stream)
