"""What settle charges for each way a forwarded request ends, and the record it leaves
(extproc.request.settle over extproc.policy.charge; times moved by a fake clock)."""

from __future__ import annotations

import asyncio
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.schema import build_policy, hash_key
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime
from tests.test_stream import Clock, headers


def _runtime(clock: Clock, response_processing: str = "usage_trailers") -> Runtime:
    rt = Runtime(
        build_policy(
            {
                "gateway": {"response_processing": response_processing},
                "backends": [
                    {
                        "name": "b",
                        "address": "127.0.0.1:1",
                        "max_concurrency": 4,
                        "models": [{"name": "m", "context_window": 8192}],
                    }
                ],
                "tiers": {"t": {"tpm": 1_000_000, "rpm": 1000}},
                "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
            }
        ),
        clock=clock,
    )
    rt.backends["b"].has_metrics = False
    return rt


def _forward(rt: Runtime, stream: bool = False, max_tokens: int = 1000) -> StreamProcessor:
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]  # nothing queues here
    hdr = headers(
        _path="/v1/chat/completions", _method="POST", authorization="Bearer k", x_request_id="rq-1"
    )
    sp.handle("request_headers", hdr)
    raw = json.dumps(
        {
            "model": "m",
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()

    async def run() -> None:
        async for _ in sp.handle_body(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
        ):
            pass

    asyncio.run(run())
    assert sp.settlement is not None and sp.settlement.sent_upstream
    return sp


def test_a_client_gone_before_any_answer_pays_the_prompt_plus_the_estimated_generation() -> None:
    clock = Clock()
    rt = _runtime(clock)
    rt.decode_rates.rates["m"] = 50.0  # learned from earlier streams
    sp = _forward(rt)
    prompt = sp.settlement.prompt_tokens
    clock.now += 9.0  # the engine generated for nine seconds; then the client hung up
    sp.settle("disconnect")
    rec = rt.settle_log.report()["requests"][-1]
    assert (
        rec["basis"] == "estimated" and rec["request_id"] == "rq-1" and rec["how"] == "disconnect"
    )
    assert rec["charged"] == prompt + 450 and rec["reserved"] == prompt + 1000
    assert rt.status()["ledger"]["balanced"] and rt.status()["in_flight"] == 0
    rt.close()


def test_without_a_learned_rate_it_pays_the_reservation_and_never_more() -> None:
    clock = Clock()
    rt = _runtime(clock)
    sp = _forward(rt, max_tokens=300)
    clock.now += 60.0
    sp.settle("disconnect")
    rec = rt.settle_log.report()["requests"][-1]
    assert rec["charged"] == rec["reserved"] == sp.settlement.prompt_tokens + 300
    rt.close()


def test_an_error_answer_is_not_billed_and_an_unknown_key_leaves_no_record() -> (
    None
):
    clock = Clock()
    rt = _runtime(clock)
    sp = _forward(rt)
    resp = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=headers(_status="500").request_headers.headers)
    )
    sp.handle("response_headers", resp)
    rec = rt.settle_log.report()["requests"][-1]
    assert (rec["basis"], rec["charged"], rec["status"]) == ("failed", 0, 500)

    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    sp.handle(
        "request_headers",
        headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer nope"),
    )
    sp.settle("rejected")
    assert (
        rt.settle_log.count == 1
    )  # refused before its key was known: nothing was held, nothing settled
    rt.close()


def test_a_streamed_body_cut_before_its_end_is_estimated_but_a_stream_is_counted() -> None:
    clock = Clock()
    rt = _runtime(clock, "streamed")
    rt.decode_rates.rates["m"] = 50.0
    sp = _forward(rt)
    first = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=b'{"choices": [{"message"', end_of_stream=False)
    )
    first.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    clock.now += 2.0
    sp.handle("response_body", first)
    clock.now += 1.0
    sp.settle("disconnect")
    rec = rt.settle_log.report()["requests"][-1]
    assert (
        rec["basis"] == "estimated" and rec["charged"] == sp.settlement.prompt_tokens + 100
    )  # first byte - admission: 2 s

    sp = _forward(rt, stream=True)
    event = b'data: {"choices": [{"index": 0, "delta": {"content": " the of and"}}]}\n\n'
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=event, end_of_stream=False))
    chunk.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    sp.handle("response_body", chunk)
    sp.settle("disconnect")
    rec = rt.settle_log.report(after=1)["requests"][-1]
    assert rec["basis"] == "counted" and rec["charged"] == sp.settlement.prompt_tokens + 3
    rt.close()
