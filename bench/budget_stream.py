"""A whole request through ``StreamProcessor`` in process, with and without a budget.

The ext_proc messages of one small chat completion (request headers, body, the response
body with its usage) are handed to a fresh ``StreamProcessor`` as the gRPC loop would,
on one runtime with in-process state; the simulated backend is not involved. Used by
``bench.budget_cost --stream``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.schema import build_policy, hash_key
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime


def _policy(budget: bool) -> Any:
    tier: dict[str, Any] = {"tpm": 10**9, "rpm": 10**9, "max_concurrency": 1000}
    if budget:
        tier["budget"] = {"period": "month", "tokens": 10**15, "cost": 10**6}
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 1000, "models": [
            {"name": "m", "context_window": 4096, "price": {"input": 0.2, "output": 0.6}}]}],
        "tiers": {"t": tier}, "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}]})


def _messages() -> list[pb.ProcessingRequest]:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in (
        (":path", "/v1/chat/completions"), (":method", "POST"), ("authorization", "Bearer k"),
        ("content-type", "application/json"))])
    body = json.dumps({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hello there"}]})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 30}}).encode()
    resp = pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True))
    resp.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)), resp]


async def _one(rt: Runtime, messages: list[pb.ProcessingRequest]) -> None:
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]  # nothing waits in a queue here
    for m in messages:
        phase = m.WhichOneof("request")
        if phase == "request_body":
            async for _ in sp.handle_body(m):
                pass
        else:
            sp.handle(phase, m)
    assert sp.settled


def request_cost(n: int, budget: bool) -> float:
    """CPU microseconds of this process per request, over ``n`` requests."""
    rt = Runtime(_policy(budget))
    rt.backends["b"].has_metrics = False
    messages = _messages()
    loop = asyncio.new_event_loop()

    async def go(k: int) -> None:
        for _ in range(k):
            await _one(rt, messages)

    loop.run_until_complete(go(max(20, n // 10)))  # warm up
    t0 = time.process_time()
    loop.run_until_complete(go(n))
    us = (time.process_time() - t0) / n * 1e6
    loop.close()
    rt.close()
    return us
