"""The request path counts through extproc.runtime.metrics' intent methods, each event in one place;
the recording fake (tests.metrics_fake) sees them, and Prometheus says the same."""

from __future__ import annotations

import asyncio
import inspect

from extproc.runtime.metrics import INTENTS, NO_TENANT, Metrics
from extproc.runtime.runtime import Runtime
from tests.metrics_fake import RecordingMetrics
from tests.test_stream import Clock, body, exchange, headers, policy, response

CHAT = {"_path": "/v1/chat/completions", "_method": "POST"}


def runtime(tpm: int = 100_000) -> tuple[Runtime, RecordingMetrics]:
    rec = RecordingMetrics()
    rt = Runtime(policy(tpm), clock=Clock(), metrics=rec)
    rt.backends["b"].has_metrics = False
    return rt, rec


def value(m: Metrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_every_intent_is_a_method_and_every_event_method_an_intent() -> None:
    plumbing = {"child", "forget", "render"}
    methods = {n for n, f in inspect.getmembers(Metrics, inspect.isfunction) if not n.startswith("_")}
    assert methods - plumbing == set(INTENTS)


def test_a_rejection_is_counted_once_with_its_reason() -> None:
    rt, rec = runtime(tpm=100)
    out = asyncio.run(exchange(rt, headers(**CHAT, authorization="Bearer k"), body(500)))
    assert out[-1].immediate_response.status.code == 429
    e = rec.one("rejected")
    assert e.args == {"reason": "tpm_request_too_large", "status": 429, "tenant": "a"}
    assert rec.count("admitted") == 0 and rec.count("settled") == 0 and rec.count("released") == 0
    # Its counted prompt is charged as spent (extproc.request.settle), once.
    assert rec.one("charged_refused", tenant="a", reason="tpm_request_too_large").args["tokens"] > 0
    # Prometheus and /debug/state say the same, from that one call.
    assert value(rec, "sluice_rejections_total", reason="tpm_request_too_large", status="429") == 1
    assert value(rec, "sluice_requests_total", tenant="a", outcome="tpm_request_too_large") == 1
    assert rt.status()["tenants"]["a"]["rejections"] == {"tpm_request_too_large": 1}
    rt.close()


def test_a_request_refused_before_its_key_is_known_counts_under_no_tenant() -> None:
    rt, rec = runtime()
    out = asyncio.run(exchange(rt, headers(**CHAT, authorization="Bearer nope"), body(5)))
    assert out[-1].immediate_response.status.code == 401
    assert rec.one("rejected").args == {"reason": "unknown_key", "status": 401, "tenant": NO_TENANT}
    assert value(rec, "sluice_requests_total", tenant=NO_TENANT, outcome="unknown_key") == 1
    assert rt.status()["tenants"]["a"]["rejections"] == {}
    rt.close()


def test_an_admitted_request_is_admitted_released_and_settled_once() -> None:
    rt, rec = runtime()
    out = asyncio.run(exchange(rt, headers(**CHAT, authorization="Bearer k"), body(10), response(200)))
    assert not out[-1].HasField("immediate_response")
    admitted = rec.one("admitted", tenant="a", tier="t", degraded=())
    settled = rec.one("settled", how="end_of_stream", tenant="a")
    assert settled.args["reserved"] == admitted.args["cost"] and settled.args["charged"] == 6  # the usage: 5 + 1
    rec.one("released")
    assert rec.count("rejected") == 0
    order = [n for n in rec.names() if n in ("admitted", "released", "settled")]
    assert order == ["admitted", "released", "settled"]
    assert {e.args["phase"] for e in rec.calls("phase")} >= {"request_headers", "request_body", "response_body"}
    assert value(rec, "sluice_in_flight_requests") == 0
    assert value(rec, "sluice_tokens_charged_total", tenant="a") == 6
    assert value(rec, "sluice_settles_total", how="end_of_stream") == 1
    rt.close()


def test_a_drained_upload_is_a_rejection_but_not_a_request() -> None:
    m = Metrics()
    m.rejected("body_too_large", 413)
    m.drained_upload("drained", 1000)
    assert value(m, "sluice_rejections_total", reason="body_too_large", status="413") == 1
    assert b"sluice_requests_total{" not in m.render()
    assert value(m, "sluice_drained_uploads_total", outcome="drained") == 1
    assert value(m, "sluice_drained_bytes_total") == 1000
    assert not m.tenant_rejections


def test_the_fake_refuses_a_name_that_is_no_intent() -> None:
    rec = RecordingMetrics()
    rec.settled("error", "a", 3, 10)
    assert rec.one("settled").args == {"how": "error", "tenant": "a", "charged": 3, "reserved": 10,
                                       "basis": ""}
    try:
        rec.count("rejection")
    except AssertionError as exc:
        assert "not an intent" in str(exc)
    else:
        raise AssertionError("a misspelt intent must fail loudly")
    assert value(rec, "sluice_tokens_refunded_total", tenant="a") == 7
