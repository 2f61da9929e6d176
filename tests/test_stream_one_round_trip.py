"""The request side in one round trip, and settles from Envoy's access log, in process.

Envoy (``send_body_without_waiting_for_header_response``) sends the request headers and
every body chunk back to back; Sluice answers the headers once the body is complete,
with every mutation, then each chunk. Under ``response_processing: access_log`` the
stream ends there and the request settles from its access-log entry, or by expiry.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import usage_record
from extproc.envoy.headers import SETTLE_KEY
from extproc.policy.schema import build_policy, hash_key
from extproc.request.intake import chunked_limit
from extproc.request.log_settle import LogSettles, expires_after_s
from extproc.request.outcome import DISCONNECT, END_OF_STREAM, from_log_entry
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime
from extproc.wire.messages import METADATA_NAMESPACE, RESPONSE_MODES
from tests.test_stream import Clock

CHAT = "/v1/chat/completions"


def policy(**gateway: Any) -> Any:
    return build_policy({
        "gateway": {"max_body_bytes": 4096, **gateway},
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                      "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"t": {"tpm": 100_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


def headers(path: str = CHAT, key: str = "k", defer: bool = True, **more: str) -> pb.ProcessingRequest:
    hs = {":path": path, ":method": "POST", "authorization": f"Bearer {key}", **more}
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm))
    # What Envoy's first message says of its config (ext_proc.cc, encodeProtocolConfig).
    req.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    req.protocol_config.send_body_without_waiting_for_header_response = defer
    return req


def chunks(raw: bytes, *cuts: int) -> list[pb.ProcessingRequest]:
    """The body as Envoy streams it: pieces, then an empty end-of-stream chunk (HTTP/1.1)."""
    edges = [0, *cuts, len(raw)]
    out = [pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[a:b]))
           for a, b in zip(edges, edges[1:], strict=False)]
    return [*out, pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))]


def chat(max_tokens: int | None = 10, **more: Any) -> bytes:
    doc: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    return json.dumps(doc).encode()


async def _answers(sp: StreamProcessor, messages: list[pb.ProcessingRequest]) -> list[list[pb.ProcessingResponse]]:
    out = []
    for m in messages:
        phase = m.WhichOneof("request")
        if phase == "request_body":
            # The forward answer comes in wire form (extproc.wire.forward_answer): read it back.
            out.append([pb.ProcessingResponse.FromString(r) if isinstance(r, bytes) else r
                        async for r in sp.handle_body(m)])
        else:
            r = sp.handle(phase, m)
            out.append([] if r is None else [r])
    return out


def run(sp: StreamProcessor, *messages: pb.ProcessingRequest) -> list[list[pb.ProcessingResponse]]:
    """Each message's answers, in order (an empty list: not answered yet)."""
    return asyncio.run(_answers(sp, list(messages)))


def mutation(resp: pb.ProcessingResponse) -> tuple[dict[str, str], list[str]]:
    common = resp.request_headers.response
    return ({h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers},
            list(common.header_mutation.remove_headers))


def runtime(**gateway: Any) -> Runtime:
    rt = Runtime(policy(**gateway), clock=Clock())
    rt.backends["b"].has_metrics = False
    return rt


def test_the_headers_answer_waits_for_the_body_and_carries_every_mutation() -> None:
    rt = runtime()
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    raw = chat(max_tokens=None)  # no max_tokens: Sluice writes its default into the body
    answers = run(sp, headers(path=CHAT + "?api_key=k"), *chunks(raw, 10, 30))
    assert answers[:3] == [[], [], []]  # the headers and the first chunks wait
    final = answers[-1]
    # the headers' answer, then one answer per body message (3 pieces and the end)
    assert [r.WhichOneof("response") for r in final] == ["request_headers", *["request_body"] * 4]
    set_headers, removed = mutation(final[0])
    assert set_headers["x-sluice-backend"] == "b" and set_headers["x-sluice-tenant"] == "a"
    assert set_headers[":path"] == CHAT  # the key in the query string never goes upstream
    assert "authorization" in removed
    assert final[0].request_headers.response.clear_route_cache  # the route is picked again
    new_body = final[1].request_body.response.body_mutation.body
    assert json.loads(new_body)["max_tokens"] == 1024 and set_headers["content-length"] == str(len(new_body))
    # the first chunk carries the whole rewritten body, the others are emptied
    assert all(r.request_body.response.body_mutation.clear_body for r in final[2:])
    # the mode of the route it matched, for a filter that takes a mode_override
    assert final[0].mode_override == RESPONSE_MODES["usage_trailers"]
    rl = final[0].dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    assert rl["x-ratelimit-limit-tokens"].string_value == "100000"
    assert sp.settlement is not None and sp.settlement.sent_upstream and sp.settlement.admitted and not sp.settled
    sp.end("disconnect")
    assert rt.status()["ledger"]["balanced"] and rt.status()["in_flight"] == 0
    rt.close()


def test_an_unchanged_body_goes_on_as_it_came_with_its_length() -> None:
    rt = runtime()
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    raw = chat(max_tokens=10)
    final = run(sp, headers(), *chunks(raw, 7))[-1]
    assert len(final) == 4
    assert all(not r.request_body.response.HasField("body_mutation") for r in final[1:])
    # a chunked upload has no content-length; Envoy keeps the client's otherwise
    assert mutation(final[0])[0]["content-length"] == str(len(raw))
    sp.end("disconnect")
    rt.close()


def test_a_refusal_at_the_headers_does_not_wait_for_the_body() -> None:
    rt = runtime()
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    (first,) = run(sp, headers(key="nope"))[0]
    assert first.immediate_response.status.code == 401 and sp.finished
    rt.close()


class WideningPeer:
    """A peer whose transport windows a stream (extproc.wire.h2grpc): what it was told to expect."""

    def __init__(self) -> None:
        self.expected: list[int] = []

    def expect(self, ahead: int) -> None:
        self.expected.append(ahead)


def test_the_peer_is_told_how_much_body_comes_once_the_headers_pass() -> None:
    """Past its headers a request's body will be read: its transport lets it all come at
    once (the content-length, or a chunked upload's most, and the messages' framing); a
    request refused from its headers asks for none of it."""
    rt = runtime()  # max_body_bytes 4096
    raw = chat()
    for more, at_least in (({"content-length": str(len(raw))}, len(raw)), ({}, chunked_limit(4096))):
        peer = WideningPeer()
        sp = StreamProcessor(rt, peer=peer)  # type: ignore[arg-type]
        assert run(sp, headers(**more)) == [[]]
        (ahead,) = peer.expected
        assert at_least < ahead < at_least * 1.01 + (16 << 10)
        run(sp, *chunks(raw))
        sp.end("disconnect")
    peer = WideningPeer()
    sp = StreamProcessor(rt, peer=peer)  # type: ignore[arg-type]
    run(sp, headers(key="nope"))
    assert sp.finished and peer.expected == []
    assert rt.status()["ledger"]["balanced"] and rt.status()["in_flight"] == 0
    rt.close()


def test_a_chunked_upload_over_the_cap_is_refused_at_its_end_or_before_envoy_stalls() -> None:
    rt = runtime()  # max_body_bytes 4096; Envoy's buffer max(2 x, cap + 1 MiB)
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    big = chat(content_pad="x" * 5000)
    answers = run(sp, headers(), *chunks(big, 2000))
    assert answers[1] == [] and answers[2] == []  # over the cap, still read to its end
    (refusal,) = answers[3]
    assert refusal.immediate_response.status.code == 413
    assert f"Request body is {len(big)} bytes" in json.loads(refusal.immediate_response.body)["error"]["message"]

    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    huge = [pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 65536)) for _ in range(10)]
    answers = run(sp, headers(), *huge)
    refused = [i for i, a in enumerate(answers) if a]
    # refused once past halfway between the cap and Envoy's buffer, not at its end
    assert refused and refused[0] < len(huge) and answers[refused[0]][0].immediate_response.status.code == 413
    assert "more than" in json.loads(answers[refused[0]][0].immediate_response.body)["error"]["message"]
    assert rt.status()["ledger"]["balanced"] and rt.status()["in_flight"] == 0
    rt.close()


def test_an_envoy_that_buffers_the_body_gets_the_headers_answered_at_once() -> None:
    # An Envoy config rendered before the one-round-trip request side (body BUFFERED).
    rt = runtime()
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(), end_of_stream=True))
    (first,), (answer,) = run(sp, headers(defer=False), body)
    assert first.HasField("request_headers")
    common = answer.request_body.response
    assert common.clear_route_cache and {h.header.key for h in common.header_mutation.set_headers} >= {
        "x-sluice-backend", "x-sluice-tenant"}
    sp.end("disconnect")
    rt.close()


# -- settles from Envoy's access log --------------------------------------------------------
def entry(settle: str, status: int = 200, usage: tuple[int, int] | None = (5, 7), ttfb: float = 0.05,
          end: float = 0.3, served: str = "127.0.0.1:1", **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    c = e.common_properties
    c.metadata.filter_metadata[METADATA_NAMESPACE].fields[SETTLE_KEY].string_value = settle
    if status:
        e.response.response_code.value = status
        c.time_to_first_upstream_rx_byte.FromNanoseconds(int(ttfb * 1e9))
    c.time_to_last_downstream_tx_byte.FromNanoseconds(int(end * 1e9))
    host, port = served.rsplit(":", 1)
    c.upstream_remote_address.socket_address.address, c.upstream_remote_address.socket_address.port_value = \
        host, int(port)
    e.response.response_headers["content-type"] = "application/json"
    for name, value in flags.items():
        setattr(c.response_flags, name, value)
    if usage is not None:
        u = usage_record.TokenUsage()
        u.input_tokens.value, u.output_tokens.value, u.total_tokens.value = usage[0], usage[1], sum(usage)
        u.extraction_status = usage_record.EXTRACTION_COMPLETE
        packed = c.metadata.typed_filter_metadata[usage_record.USAGE_NAMESPACE]
        packed.type_url, packed.value = "type.googleapis.com/" + usage_record.TOKEN_USAGE, u.SerializeToString()
    return e


def forwarded(rt: Runtime, settles: LogSettles) -> tuple[StreamProcessor, str]:
    """A request answered and forwarded under access_log, its stream ended as Envoy ends it."""
    sp = StreamProcessor(rt, peer=None, log_settles=settles)  # type: ignore[arg-type]
    final = run(sp, headers(), *chunks(chat(max_tokens=50)))[-1]
    key = final[0].dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[SETTLE_KEY].string_value
    sp.end("disconnect")  # the ext_proc stream ends once the request is answered
    return sp, key


def test_a_forwarded_request_settles_from_its_log_entry_once() -> None:
    rt = runtime(response_processing="access_log")
    settles = LogSettles("127.0.0.1:50051", rt.clock, rt.metrics)
    sp, key = forwarded(rt, settles)
    assert key.startswith("127.0.0.1:50051/") and sp.awaiting_log == key
    assert not sp.settled and rt.status()["in_flight"] == 1 and len(settles) == 1
    rt.clock.now += 0.5  # type: ignore[attr-defined]
    settles.consume([entry(key)])
    assert sp.settled and len(settles) == 0
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["charged"] == 12 and st["ledger"]["balanced"], st["ledger"]
    # the times are the response's, not the batch's: first byte and end after the start
    assert sp.settlement.first_byte_s == sp.arrived_s + 0.05 and sp.settlement.ended_s is not None
    assert abs(sp.settlement.ended_s - (sp.arrived_s + 0.3)) < 1e-6
    lag = rt.metrics.registry.get_sample_value("sluice_settle_lag_seconds_sum")
    assert lag is not None and abs(lag - 0.2) < 1e-6  # 0.5 s after the start, the response ended at 0.3
    settles.consume([entry(key)])  # a duplicate is ignored, never billed twice
    assert rt.status()["ledger"]["charged"] == 12
    assert rt.metrics.registry.get_sample_value("sluice_access_log_entries_total", {"outcome": "unknown"}) == 1
    rt.close()


def test_a_lost_entry_expires_keeps_its_precharge_and_a_late_one_is_ignored() -> None:
    rt = runtime(response_processing="access_log", response_timeout_s=30)
    settles = LogSettles("s", rt.clock, rt.metrics)
    sp, key = forwarded(rt, settles)
    reserved = sp.settlement.reserved
    assert settles.expire(rt.clock() + expires_after_s(30) - 0.01) == 0
    assert settles.expire(rt.clock() + expires_after_s(30)) == 1
    st = rt.status()
    assert sp.settled and st["in_flight"] == 0 and rt.backends["b"].pool.in_use().total == 0
    assert st["ledger"]["charged"] == reserved and st["ledger"]["balanced"], st["ledger"]
    rec = rt.settle_log.report()["requests"][-1]
    assert rec["how"] == "expired" and rec["basis"] == "lost" and rec["charged"] == reserved
    settles.consume([entry(key)])  # after its expiry: ignored
    assert rt.status()["ledger"]["charged"] == reserved
    assert rt.metrics.registry.get_sample_value("sluice_access_log_entries_total", {"outcome": "late"}) == 1
    assert rt.metrics.registry.get_sample_value("sluice_access_log_expired_total") == 1
    rt.close()


def test_a_client_gone_mid_response_is_billed_as_a_disconnect() -> None:
    rt = runtime(response_processing="access_log")
    settles = LogSettles("s", rt.clock, rt.metrics)
    sp, key = forwarded(rt, settles)
    settles.consume([entry(key, usage=None, downstream_connection_termination=True)])
    # No usage: the prompt and the completion estimated from the time it streamed, as the
    # usage_trailers path bills a disconnect after the response headers.
    assert sp.settled and sp.settlement.status == 200
    st = rt.status()
    assert st["in_flight"] == 0 and st["ledger"]["balanced"]
    assert sp.settlement.prompt_tokens <= st["ledger"]["charged"] <= sp.settlement.reserved
    rt.close()


def test_a_disconnect_from_the_log_is_charged_as_the_stream_path_charges_it() -> None:
    """One rule for what a request is charged (extproc.policy.charge): a client gone
    mid-stream, told by its access-log entry (flag DC, no usage), pays what the same
    disconnect pays when the ext_proc stream tells it; the times are the entry's own."""
    charged = {}
    for mode in ("access_log", "usage_trailers"):
        rt = runtime(response_processing=mode)
        rt.decode_rates.rates["m"] = 50.0  # learned from earlier streams
        settles = LogSettles("s", rt.clock, rt.metrics)
        sp = StreamProcessor(rt, peer=None, log_settles=settles)  # type: ignore[arg-type]
        final = run(sp, headers(), *chunks(chat(max_tokens=1000, stream=True)))[-1]
        if mode == "access_log":
            key = final[0].dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[SETTLE_KEY]
            sp.end("disconnect")  # the stream ends once the request is answered; the response goes on
            e = entry(key.string_value, usage=None, ttfb=1.0, end=5.0, downstream_connection_termination=True)
            e.response.response_headers["content-type"] = "text/event-stream"
            rt.clock.now += 30.0  # the entry comes late: the charge is by its times, not the arrival
            settles.consume([e])
        else:
            rt.clock.now += 1.0
            hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                                             base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")])
            sp.handle("response_headers", pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm)))
            rt.clock.now += 4.0
            sp.end("disconnect")
        rec = rt.settle_log.report()["requests"][-1]
        assert rec["how"] == "disconnect" and rec["basis"] == "estimated", rec
        assert rt.status()["ledger"]["balanced"] and rt.status()["in_flight"] == 0
        charged[mode] = rec["charged"]
        prompt = sp.settlement.prompt_tokens
        rt.close()
    # 4 s streamed at 50 tokens/s after the prompt
    assert charged["access_log"] == charged["usage_trailers"] == prompt + 200, charged


def test_a_request_refused_at_its_headers_never_waits_for_a_log_entry() -> None:
    rt = runtime(response_processing="access_log")
    settles = LogSettles("s", rt.clock, rt.metrics)
    sp = StreamProcessor(rt, peer=None, log_settles=settles)  # type: ignore[arg-type]
    run(sp, headers(key="nope"))
    sp.end("rejected")
    assert len(settles) == 0 and sp.awaiting_log is None
    rt.close()


def test_log_entries_map_into_one_outcome() -> None:
    ok = from_log_entry(entry("x", status=200, served="10.0.0.2:8000"))
    assert ok.how == END_OF_STREAM and ok.status == 200 and ok.served == "10.0.0.2:8000"
    assert ok.usage is not None and (ok.usage.input_tokens, ok.usage.output_tokens) == (5, 7) and not ok.sse
    assert abs(ok.first_byte_after_s - 0.05) < 1e-9 and abs(ok.ended_after_s - 0.3) < 1e-9  # type: ignore[operator]
    # an upstream that failed before answering: Envoy's own reply, a status of its own
    refused = from_log_entry(entry("x", status=503, usage=None, upstream_connection_failure=True))
    assert refused.how == END_OF_STREAM and refused.status == 503 and refused.usage is None
    for flag in ("downstream_connection_termination", "downstream_remote_reset", "upstream_remote_reset"):
        assert from_log_entry(entry("x", usage=None, **{flag: True})).how == DISCONNECT
    gone = from_log_entry(entry("x", status=0, usage=None, downstream_connection_termination=True))
    assert gone.how == DISCONNECT and gone.status == 0 and gone.first_byte_after_s is None


def test_the_waiting_list_forgets_settled_ids_without_waiting_for_their_expiry() -> None:
    rt = runtime(response_processing="access_log")
    settles = LogSettles("s", rt.clock, rt.metrics)

    class Done:
        arrived_s = 0.0

        def settle_with(self, outcome: Any) -> None:
            pass

        def settle_expired(self) -> None:
            raise AssertionError("settled from its entry")

    for _ in range(5000):
        settles.consume([entry(settles.register(Done(), 1e9))])
    assert len(settles) == 0
    assert len(settles._deadlines) <= 1024 + 1  # compacted, not 5000 expiries kept
    assert settles.expire(2e9) == 0
    rt.close()


def test_a_config_that_streams_the_response_settles_on_the_stream_even_under_access_log() -> None:
    # A gateway's own Envoy config (deploy/examples/envoy-gateway-extproc) streams the
    # response whatever the policy says: no log entry will come, so nothing waits for one.
    rt = runtime(response_processing="access_log")
    settles = LogSettles("s", rt.clock, rt.metrics)
    sp = StreamProcessor(rt, peer=None, log_settles=settles)  # type: ignore[arg-type]
    head = headers()
    head.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    run(sp, head, *chunks(chat(max_tokens=50)))
    assert sp.awaiting_log is None and len(settles) == 0
    sp.end("disconnect")  # the client left mid-response: settled now, not at an expiry
    assert sp.settled and rt.status()["in_flight"] == 0 and rt.status()["ledger"]["balanced"]
    rt.close()
