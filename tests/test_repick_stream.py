"""Re-pick once on a connect failure, the extproc side, driven by ext_proc messages.

Request side: ``x-sluice-endpoint: pick,second`` (or the pick and ``x-envoy-max-retries: 0``),
and a client's retry headers removed. Response side: Envoy's ``upstream.address`` attribute
says who served, and the hold follows the request there.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.backends.pool_report import endpoint_status
from extproc.envoy.headers import CLIENT_RETRY_HEADERS, ENDPOINT_HEADER, MAX_RETRIES_HEADER
from extproc.policy.breaker import BreakerState
from extproc.policy.schema import build_policy, hash_key
from extproc.request.stream import StreamProcessor
from extproc.runtime import leases
from extproc.runtime.runtime import Runtime
from tests.test_stream import Clock, headers, stream_body, trailers

A, B, C = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"
CHAT = "/v1/chat/completions"


def policy(endpoints: list[str] | None = (A, B), placement: dict[str, Any] | None = None,  # type: ignore[assignment]
           **gateway: Any) -> Any:
    backend: dict[str, Any] = {"name": "pool", "max_concurrency": 8, **({"placement": placement} if placement else {}),
                               # one tenant: attribution off, its failures are the engines'
                               # (tests/test_tenant_breaker_stream.py is about who is blamed)
                               "breaker": {"consecutive_failures": 1, "cooldown_s": 5,
                                           "max_cooldown_s": 10, "min_failing_tenants": 1},
                               "models": [{"name": "m", "context_window": 4096}]}
    if endpoints is None:
        backend["address"] = "127.0.0.1:7001"
    else:
        backend["endpoints"] = [{"address": e, "kv_capacity_tokens": 10_000} for e in endpoints]
    return build_policy({
        "gateway": gateway,
        "backends": [backend],
        "tiers": {"t": {"tpm": 1_000_000, "rpm": 1000}},
        "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("k")]}],
    })


def runtime(p: Any) -> tuple[Runtime, Clock]:
    clock = Clock()
    rt = Runtime(p, clock=clock)
    rt.backends["pool"].has_metrics = False
    return rt, clock


def request(rt: Runtime, prompt: str = "hi", **client: str) -> tuple[StreamProcessor, pb.CommonResponse]:
    """A chat request through request headers and body; the body answer's common response."""
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    assert sp.handle("request_headers", headers(_path=CHAT, _method="POST", authorization="Bearer k",
                                                **client)) is not None
    (answer,) = asyncio.run(_body(sp, prompt))
    return sp, answer.request_body.response


async def _body(sp: StreamProcessor, prompt: str) -> list[pb.ProcessingResponse]:
    b = stream_body(100)
    if prompt != "hi":
        doc = json.loads(b.request_body.body)
        doc["messages"][0]["content"] = prompt
        b.request_body.body = json.dumps(doc).encode()
    return [r async for r in sp.handle_body(b)]


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def served_by(upstream: str | None, status: int = 200) -> pb.ProcessingRequest:
    """Response headers, with Envoy's upstream.address attribute when ``upstream`` is given."""
    hs = [(":status", str(status)), ("content-type", "text/event-stream")]
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])
    r = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))
    return r if upstream is None else with_upstream_attribute(r, upstream)


def repicks(rt: Runtime, frm: str, to: str) -> float:
    v = rt.metrics.registry.get_sample_value("sluice_endpoint_repicks_total",
                                             {"backend": "pool", "from_endpoint": frm, "to_endpoint": to})
    return v or 0.0


def held(rt: Runtime) -> dict[str, tuple[int, int]]:
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    return {k: (st.in_flight, st.kv_in_use) for k, st in eps.by_key.items()}


HOSTILE = {h.replace("-", "_"): "5xx" for h in CLIENT_RETRY_HEADERS}


# -- request side ---------------------------------------------------------------------------

def test_a_pool_request_names_its_pick_and_second_choice_and_no_client_retry_header_survives() -> None:
    rt, _ = runtime(policy((A, B, C)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    eps.by_key[C].kv_in_use = 5000  # C is the fullest: the last choice
    sp, common = request(rt, **HOSTILE)
    assert sp.ticket is not None and sp.ticket.hold is not None
    assert (sp.ticket.hold.endpoint, sp.ticket.hold.second) == (A, B)
    got = set_headers(common)
    assert got[ENDPOINT_HEADER] == f"{A},{B}"
    assert MAX_RETRIES_HEADER not in got  # Envoy's route retries once, on the second
    assert set(CLIENT_RETRY_HEADERS) <= set(common.header_mutation.remove_headers)
    # Nothing is reserved on the second choice.
    assert held(rt)[B] == (0, 0) and held(rt)[A][0] == 1
    sp.settle("disconnect")
    assert held(rt) == {A: (0, 0), B: (0, 0), C: (0, 5000)}
    rt.close()


def test_without_a_second_choice_envoy_is_told_not_to_retry() -> None:
    rt, _ = runtime(policy((A, B)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    eps.by_key[B].draining = True  # not usable: no second choice
    sp, common = request(rt, **HOSTILE)
    got = set_headers(common)
    assert got[ENDPOINT_HEADER] == A and got[MAX_RETRIES_HEADER] == "0"
    removed = set(common.header_mutation.remove_headers)
    # The client's x-envoy-max-retries is overwritten (set and removed in one mutation would race).
    assert MAX_RETRIES_HEADER not in removed and set(CLIENT_RETRY_HEADERS) - {MAX_RETRIES_HEADER} <= removed
    sp.settle("disconnect")
    rt.close()


def test_a_single_address_backend_gets_no_endpoint_headers_but_loses_the_clients_retry_headers() -> None:
    rt, _ = runtime(policy(None))
    sp, common = request(rt, **HOSTILE)
    got = set_headers(common)
    assert ENDPOINT_HEADER not in got and MAX_RETRIES_HEADER not in got
    assert set(CLIENT_RETRY_HEADERS) <= set(common.header_mutation.remove_headers)
    sp.settle("disconnect")
    rt.close()


def test_a_passthrough_path_to_a_pool_names_one_endpoint_without_retries_and_drops_client_retry_headers() -> None:
    rt, _ = runtime(policy((A, B), unknown_paths="passthrough"))
    sp = StreamProcessor(rt, peer=None)  # type: ignore[arg-type]
    r = sp.handle("request_headers", headers(_path="/v1/files", _method="GET", authorization="Bearer k", **HOSTILE))
    assert r is not None
    common = r.request_headers.response
    got = set_headers(common)
    assert got[ENDPOINT_HEADER] in (A, B) and got[MAX_RETRIES_HEADER] == "0"
    assert set(CLIENT_RETRY_HEADERS) - {MAX_RETRIES_HEADER} <= set(common.header_mutation.remove_headers)
    rt.close()


# -- response side --------------------------------------------------------------------------

def test_served_by_the_second_choice_moves_the_hold_once_records_the_failure_and_counts_it() -> None:
    rt, clock = runtime(policy((A, B)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    sp, _ = request(rt)
    assert sp.ticket is not None and sp.ticket.hold is not None
    kv = sp.ticket.hold.kv
    assert held(rt) == {A: (1, kv), B: (0, 0)}
    out = sp.handle("response_headers", served_by(B))
    assert out is not None and not out.response_headers.HasField("response")  # nothing to mutate
    assert sp.ticket.hold.endpoint == B
    assert held(rt) == {A: (0, 0), B: (1, kv)}
    assert eps.by_key[A].breaker.state(clock.now) is BreakerState.OPEN  # consecutive_failures: 1
    assert rt.backends["pool"].breaker.state(clock.now) is BreakerState.CLOSED
    assert repicks(rt, A, B) == 1
    status = {s["address"]: s["repicks"] for s in (endpoint_status(st, clock.now) for st in eps.by_key.values())}
    assert status == {A: {"away": 1, "here": 0}, B: {"away": 0, "here": 1}}
    # The request ends normally: settle releases B, exactly once, and B's breaker hears the success.
    sp.handle("response_trailers", trailers(5, 10))
    assert sp.settled and held(rt) == {A: (0, 0), B: (0, 0)}
    assert rt.backends["pool"].kv_in_use == 0 and rt.backends["pool"].pool.in_use().total == 0
    assert eps.by_key[B].breaker.state(clock.now) is BreakerState.CLOSED
    sp.settle("disconnect")  # any later exit path: nothing more
    assert held(rt) == {A: (0, 0), B: (0, 0)} and repicks(rt, A, B) == 1
    rt.close()


def test_served_by_the_pick_keeps_the_hold_and_mutates_nothing() -> None:
    rt, clock = runtime(policy((A, B)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    sp, _ = request(rt)
    out = sp.handle("response_headers", served_by(A))
    assert out is not None and not out.response_headers.HasField("response")
    assert sp.ticket is not None and sp.ticket.hold is not None and sp.ticket.hold.endpoint == A
    assert eps.by_key[A].breaker.state(clock.now) is BreakerState.CLOSED
    assert repicks(rt, A, B) == 0
    # A single-address backend's response: the shared answer too.
    rt2, _ = runtime(policy(None))
    sp2, _ = request(rt2)
    out2 = sp2.handle("response_headers", served_by(None))
    assert out2 is not None and not out2.response_headers.HasField("response")
    for s, r in ((sp, rt), (sp2, rt2)):
        s.handle("response_trailers", trailers(5, 10))
        r.close()
    assert held(rt) == {A: (0, 0), B: (0, 0)}


def test_an_address_outside_the_pool_is_counted_unknown_and_the_hold_stays() -> None:
    rt, clock = runtime(policy((A, B)))
    sp, _ = request(rt)
    assert sp.ticket is not None and sp.ticket.hold is not None
    kv = sp.ticket.hold.kv
    sp.handle("response_headers", served_by("10.9.9.9:1234"))
    assert sp.ticket.hold.endpoint == A and held(rt) == {A: (1, kv), B: (0, 0)}
    assert repicks(rt, A, "unknown") == 1
    sp.handle("response_trailers", trailers(5, 10))
    assert held(rt) == {A: (0, 0), B: (0, 0)}
    rt.close()


def test_an_error_from_the_second_choice_settles_there_and_both_breakers_hear_their_own_failure() -> None:
    rt, clock = runtime(policy((A, B, C)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    sp, _ = request(rt)
    sp.handle("response_headers", served_by(B, status=500))
    assert sp.settled, "an error response settles at its headers"
    assert all(v == (0, 0) for v in held(rt).values()), held(rt)
    assert eps.by_key[A].breaker.state(clock.now) is BreakerState.OPEN  # refused the connection
    assert eps.by_key[B].breaker.state(clock.now) is BreakerState.OPEN  # answered 500
    assert repicks(rt, A, B) == 1
    rt.close()


def test_both_connections_failed_envoys_503_settles_on_the_pick() -> None:
    rt, clock = runtime(policy((A, B)))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    sp, _ = request(rt)
    out = sp.handle("response_headers", served_by(None, status=503))
    assert out is not None and not out.response_headers.HasField("response")
    assert sp.settled and held(rt) == {A: (0, 0), B: (0, 0)}
    assert eps.by_key[A].breaker.state(clock.now) is BreakerState.OPEN
    assert eps.by_key[B].breaker.state(clock.now) is BreakerState.CLOSED
    assert repicks(rt, A, B) == 0
    rt.close()


def test_a_move_keeps_the_per_endpoint_lease_plan_consistent() -> None:
    """With a shared store each endpoint's lease follows st.in_flight / st.kv_in_use
    (extproc.runtime.leases): after a move the served endpoint asks for the request it
    runs, the pick for nothing, and nothing goes negative, even over the served one's lease."""
    rt, clock = runtime(policy((A, B)))
    be = rt.backends["pool"]
    eps = be.endpoints
    assert eps is not None
    for st in eps.by_key.values():
        st.leased_slots, st.leased_kv = 1, 10_000
    sp, _ = request(rt)
    assert sp.ticket is not None and sp.ticket.hold is not None
    kv = sp.ticket.hold.kv
    eps.by_key[B].leased_slots = 0  # B's lease is spent meanwhile: the request runs there all the same
    sp.handle("response_headers", served_by(B))
    assert held(rt) == {A: (0, 0), B: (1, kv)}
    shared = SimpleNamespace(short={})
    wanted = {name.split("@", 1)[1] if "@" in name else name: get()[2:4]
              for name, get in leases.usage(be.spec, be, shared, clock).items()}  # type: ignore[arg-type]
    assert sorted(wanted.values()) == [(0, 0), (1, kv)]
    sp.handle("response_trailers", trailers(5, 10))
    assert held(rt) == {A: (0, 0), B: (0, 0)}
    assert all(get()[2:4] == (0, 0) for get in leases.usage(be.spec, be, shared, clock).values())  # type: ignore[arg-type]
    rt.close()


def test_a_drained_endpoints_repick_series_leave_metrics() -> None:
    from extproc.service.series import owned, prune

    rt, clock = runtime(policy((A, B)))
    sp, _ = request(rt)
    sp.handle("response_headers", served_by(B))
    sp.handle("response_trailers", trailers(5, 10))
    clock.now += 20  # A's breaker, opened by the refused connection, is past its cooldown
    sp2, _ = request(rt)
    sp2.handle("response_headers", served_by("10.9.9.9:1"))
    sp2.handle("response_trailers", trailers(5, 10))
    assert repicks(rt, A, B) == 1 and repicks(rt, A, "unknown") == 1
    prune(rt.metrics, *owned(rt.backends))
    assert repicks(rt, A, B) == 1 and repicks(rt, A, "unknown") == 1  # both endpoints still in the pool
    p = policy((A, C))  # B leaves (it has nothing in flight: forgotten at once)
    rt.backends["pool"].reconfigure(p.backends[0], p, 100.0)
    prune(rt.metrics, *owned(rt.backends))
    assert repicks(rt, A, B) == 0 and repicks(rt, A, "unknown") == 1
    rt.close()


# -- the served address under response_processing streamed ----------------------------------

def with_upstream_attribute(r: pb.ProcessingRequest, upstream: str) -> pb.ProcessingRequest:
    r.attributes["envoy.filters.http.ext_proc"].fields["upstream.address"].string_value = upstream
    return r


def test_streamed_the_attribute_on_the_first_body_chunk_moves_the_hold_before_settle() -> None:
    rt, clock = runtime(policy((A, B), response_processing="streamed"))
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    sp, _ = request(rt)
    assert sp.ticket is not None and sp.ticket.hold is not None
    first = pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"choices": []}\n\n', end_of_stream=False))
    first.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    sp.handle("response_body", with_upstream_attribute(first, B))
    assert sp.ticket.hold.endpoint == B and repicks(rt, A, B) == 1
    assert eps.by_key[A].breaker.state(clock.now) is BreakerState.OPEN
    last = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    sp.handle("response_body", last)
    assert sp.settled and held(rt) == {A: (0, 0), B: (0, 0)}
    assert rt.backends["pool"].kv_in_use == 0
    rt.close()


def test_with_prefix_affinity_the_prefix_follows_the_request_to_the_endpoint_that_served_it() -> None:
    rt, clock = runtime(policy((A, B), placement={"prefix_affinity": True}))
    eps = rt.backends["pool"].endpoints
    assert eps is not None and eps.affinity is not None
    sp, _ = request(rt, "a long shared system prompt. " * 200)
    assert sp.ticket is not None and sp.ticket.prefix and sp.ticket.hold is not None
    assert sp.ticket.hold.endpoint == A
    found = eps.affinity.lookup(sp.ticket.prefix, clock.now)
    assert found is not None and found[0] == A
    sp.handle("response_headers", served_by(B))
    found = eps.affinity.lookup(sp.ticket.prefix, clock.now)
    assert found is not None and found[0] == B  # B's engine has the prefix cached now, not A's
    sp.handle("response_trailers", trailers(5, 10))
    rt.close()
