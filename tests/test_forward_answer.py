"""The forward answer in wire form is the message ``headers_response`` builds, whatever it holds."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import picker_protocol as pp
from extproc.wire import forward_answer
from extproc.wire import messages as msg
from extproc.wire.pbwire import length, read_varint

RATE = {"x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "999906",
        "x-ratelimit-reset-tokens": "6ms", "settle": "bench/1"}
CASES = {
    "the demo's": ({"x-sluice-tenant": "acme", "x-sluice-tier": "premium", "x-sluice-endpoint": "10.0.0.1:8000",
                    "content-length": "212"}, ("authorization", "x-api-key"), {msg.METADATA_NAMESPACE: RATE}),
    "no metadata, removals as a list": ({"x-sluice-tenant": "t"}, ["authorization"], {}),
    "nothing to set or remove": ({}, (), {msg.METADATA_NAMESPACE: {"settle": "x/2"}}),
    # past one-byte lengths: a value of 200 bytes, one of 20 KiB, a key of 130
    "long values": ({"x-long": "v" * 200, "x-" + "k" * 128: "short"}, ("a" * 300,),
                    {msg.METADATA_NAMESPACE: {"x-big": "b" * 20_000, "k" * 130: "v" * 120}}),
    "non-ASCII": ({"x-sluice-tenant": "tenant-é✓"}, (), {msg.METADATA_NAMESPACE: {"x-sluice-degraded": "ü" * 70}}),
    "two namespaces": ({"a": "b"}, ("c",), {msg.METADATA_NAMESPACE: {"k": "v"}, "envoy.lb": {"x": "1.2.3.4:80"}}),
}


@pytest.mark.parametrize("mode", [msg.response_mode("chat", "access_log"), msg.response_mode("responses", "access_log"),
                                  None], ids=["access_log", "reads-body", "no-mode"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_wire_form_parses_to_the_built_message(case: str, mode: msg.PM | None) -> None:
    set_headers, remove, metadata = CASES[case]
    for _ in range(2):  # the second time from the encoded pairs kept
        wire = forward_answer.request_headers(set_headers, remove, metadata, mode)
        built = msg.headers_response("request_headers", set_headers, remove, clear_route_cache=True,
                                     metadata=metadata, mode_override=mode)
        assert pb.ProcessingResponse.FromString(wire) == built
    assert msg.serialize(wire) is wire
    assert msg.serialize(built) == built.SerializeToString()


def test_lengths_round_trip_across_the_table_and_past_it() -> None:
    for n in (0, 1, 127, 128, 16383, 16384, 1 << 21, (1 << 35) + 3):
        assert read_varint(length(n) + b"\xff", 0) == (n, len(length(n)))


def test_the_picker_echo_still_parses() -> None:
    for chunk in (b"", b"x", b"y" * 20_000):
        got = pb.ProcessingResponse.FromString(pp.echo(pp.RESPONSE_BODY_FIELD, chunk, True))
        streamed = got.response_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (chunk, True)
