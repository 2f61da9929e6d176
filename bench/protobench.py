"""betterproto2 (envoy-data-plane) vs upb (xds-protos): what one ext_proc message
costs to parse and serialize with each, the reason the hot path uses upb.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from bench.overhead_load import MODEL
from bench.overhead_report import Row


def protobuf_rows(seconds: float = 1.5) -> list[Row]:
    """Parse + serialize a ~4 KiB request_body and a request_headers message with both classes."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingRequest as BetterRequest

    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway.example"),
            (":scheme", "https"), ("authorization", "Bearer sk-0123456789abcdef0123456789abcdef"),
            ("content-type", "application/json"), ("content-length", "4096"), ("user-agent", "OpenAI/Python 1.55"),
            ("accept", "application/json"), ("x-request-id", "0f8b6c1e-4c1f-4a9e-9a53-1b2f8e2a7d10"),
            ("x-forwarded-proto", "https"), ("x-stainless-lang", "python")]]))
    prompt = ("Summarise the following paragraph in one sentence. " * 100)[:4096 - 120]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64})
    messages = {
        "request_body, 4 KiB body": pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body.encode()[:4096], end_of_stream=True)),
        "request_headers, 12 headers": pb.ProcessingRequest(request_headers=headers),
    }
    rows = []
    for label, msg in messages.items():
        wire = msg.SerializeToString()
        better_msg = BetterRequest.parse(wire)
        if len(bytes(better_msg)) != len(wire):
            raise RuntimeError("betterproto2 round trip changed the message size")
        timings = {
            "betterproto2": _time_op(lambda w=wire: bytes(BetterRequest.parse(w)), seconds / 2),
            "upb": _time_op(lambda w=wire: pb.ProcessingRequest.FromString(w).SerializeToString(), seconds / 2),
        }
        rows.append(
            Row(
                "protobuf",
                label,
                {
                    "bytes": len(wire),
                    "betterproto2_us": timings["betterproto2"],
                    "upb_us": timings["upb"],
                    "ratio": timings["betterproto2"] / timings["upb"],
                },
            )
        )
    return rows


def _time_op(op: Callable[[], object], budget_s: float, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean µs per call of ``op`` (parse then serialize)."""
    n = 1
    while True:  # calibrate: batches of ~budget/repeats seconds
        t = time.perf_counter()
        for _ in range(n):
            op()
        if time.perf_counter() - t > 0.02 or n > 1 << 22:
            break
        n *= 2
    per_batch = max(1, int(n * (budget_s / repeats) / max(time.perf_counter() - t, 1e-9)))
    results = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(per_batch):
            op()
        results.append((time.perf_counter() - t) / per_batch * 1e6)
    return statistics.median(results)
