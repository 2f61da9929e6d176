"""Replica reports are bounded: size, nesting, shape; refused with 400 JSON, never a 500;
replicas that stop reporting leave the pages and are deleted later."""

from __future__ import annotations

import json
from typing import Any

import pytest

from console import live, reports
from tests.console.conftest import Console, text_of
from tests.console.test_status import post_status, report


def raw_status(c: Console, data: bytes, replica: str = "r1") -> Any:
    return c.api("POST", f"/api/v1/replicas/{replica}/status", data=data, content_type="application/json")


def assert_refused(r: Any, code: str) -> dict[str, Any]:
    assert r.status_code == 400, r.get_data(as_text=True)[:200]
    err = r.get_json()["error"]
    assert set(err) >= {"message", "type", "code", "param"}
    assert err["code"] == code and err["type"] == "invalid_request"
    return err


def test_deeply_nested_report_is_400_not_500(console: Console) -> None:
    for depth in (5000, 50_000):
        body = b'{"x":' + b"[" * depth + b"]" * depth + b"}"
        assert_refused(raw_status(console, body), "report_too_deep")
    # brackets inside strings do not count
    assert raw_status(console, json.dumps({"note": "[" * 5000}).encode()).status_code == 400  # too long a string
    assert reports.nesting_depth(json.dumps({"a": "[[[{{{", "b": [[1]]}).encode()) == 3
    assert console.sluice.store.one("SELECT * FROM replicas") is None


def test_report_over_256_kib_is_refused(console: Console) -> None:
    big = {"backends": {}, "tenants": {f"t{i}": {"in_flight": 1, "tier": "x" * 200} for i in range(1500)}}
    data = json.dumps(big).encode()
    assert len(data) > reports.MAX_BYTES
    err = assert_refused(raw_status(console, data), "report_too_large")
    assert str(reports.MAX_BYTES) in err["message"]


def test_too_many_backends_is_refused_and_pages_stay_small(operator: Console) -> None:
    fake = report()
    fake["backends"] = {f"fake-{i}": fake["backends"]["sim"] for i in range(8000)}
    assert_refused(post_status(operator, fake), "report_too_large")  # 8,000 backends do not fit in 256 KiB
    # 300 small ones do, and are still too many
    fake["backends"] = {f"f{i}": {"kv_usage": 0.1} for i in range(300)}
    err = assert_refused(post_status(operator, fake), "report_too_wide")
    assert err["param"] == "backends"
    assert post_status(operator, report()).status_code == 200
    assert len(operator.client.get("/").get_data()) < 100_000


@pytest.mark.parametrize("body,code,param", [
    ({"backends": {"sim": {"breaker": {"state": "x" * 1000}}}}, "report_string_too_long", "backends.sim.breaker.state"),
    ({"backends": {"k" * 1000: {}}}, "report_string_too_long", "backends"),
    ({"tenants": {"acme": {"rejections": {f"r{i}": 1 for i in range(1000)}}}}, "report_too_wide",
     "tenants.acme.rejections"),
    ({"ledger": list(range(1000))}, "report_too_wide", "ledger"),
    ([1, 2], "invalid_json", None),
])
def test_shape_violations(console: Console, body: Any, code: str, param: str | None) -> None:
    err = assert_refused(post_status(console, body), code)
    assert err["param"] == param
    assert console.sluice.store.one("SELECT * FROM replicas") is None


def test_silent_replicas_are_hidden_then_deleted(operator: Console) -> None:
    cfg = operator.sluice.config
    post_status(operator, report(), "gone")
    post_status(operator, report(), "here")
    operator.clock.t += cfg.replica_hide_after_s - 10
    post_status(operator, report(), "here")
    body = operator.client.get("/overview/replicas", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert "replica-gone" in body  # stale, still shown
    operator.clock.t += 20
    post_status(operator, report(), "here")
    body = operator.client.get("/overview/replicas", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert "replica-gone" not in body and "replica-here" in body
    assert [r["id"] for r in operator.api("GET", "/api/v1/replicas").get_json()] == ["here"]
    assert "gone" not in text_of(operator.client.get("/breakers/state", headers={"HX-Request": "true"}))
    assert operator.sluice.store.one("SELECT id FROM replicas WHERE id = 'gone'") is not None  # hidden, kept
    operator.clock.t += cfg.replica_forget_after_s
    post_status(operator, report(), "here")  # a report prunes (at most once a minute)
    assert operator.sluice.store.one("SELECT id FROM replicas WHERE id = 'gone'") is None
    live.prune(operator.sluice.store, operator.clock.t + cfg.replica_forget_after_s + 1)
    assert operator.sluice.store.query("SELECT id FROM replicas") == []


def test_backends_not_in_the_policy_cost_no_rows_and_no_page_size(operator: Console) -> None:
    fake = report()
    fake["backends"].update({f"f{i:03d}": {"kv_usage": 0.1, "breaker": {"state": "open"}, "slots": {"in_use": 1}}
                             for i in range(reports.MAX_BACKENDS - 1)})
    baseline = len(operator.client.get("/").get_data())
    for rep in ("a", "b", "c", "d"):
        assert post_status(operator, fake, rep).status_code == 200
    store = operator.sluice.store
    assert {r["backend"] for r in store.query("SELECT DISTINCT backend FROM kv_samples")} == {"sim"}
    assert {r["backend"] for r in store.query("SELECT DISTINCT backend FROM breaker_events")} == {"sim"}
    for path in ("/", "/breakers", "/overview/backends"):
        body = operator.client.get(path).get_data(as_text=True)
        assert "f007" not in body, path
    assert len(operator.client.get("/").get_data()) < baseline + 10_000


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_report_with_nan_or_infinity_is_400(console: Console, constant: str) -> None:
    body = b'{"backends": {"sim": {"kv_usage": ' + constant.encode() + b', "running": 1}}}'
    err = assert_refused(raw_status(console, body), "invalid_json")
    assert constant.lstrip("-") in err["message"]
    assert console.sluice.store.one("SELECT * FROM replicas") is None


def test_a_report_with_a_key_twice_in_one_object_is_400(console: Console) -> None:
    body = b'{"backends": {"sim": {"kv_usage": 0.1, "kv_usage": 0.9}}}'
    err = assert_refused(raw_status(console, body), "duplicate_key")
    assert err["param"] == "kv_usage"
    assert console.sluice.store.one("SELECT * FROM replicas") is None
    # The same key in two objects is not a repeat.
    ok = raw_status(console, b'{"backends": {"a": {"kv_usage": 0.1}, "b": {"kv_usage": 0.2}}}')
    assert ok.status_code == 200, ok.get_data(as_text=True)


def test_a_replica_reports_null_where_it_has_no_finite_number(console: Console) -> None:
    from extproc.service.console_client import finite

    endpoints = [{"kv_usage": float("-inf")}, {"kv_usage": 0.5}]
    doc = finite({"backends": {"sim": {"kv_usage": float("nan"), "running": 2,
                                       "waiting": float("inf"), "endpoints": endpoints}}})
    assert doc == {"backends": {"sim": {"kv_usage": None, "running": 2, "waiting": None,
                                        "endpoints": [{"kv_usage": None}, {"kv_usage": 0.5}]}}}
    assert raw_status(console, json.dumps(doc, allow_nan=False).encode()).status_code == 200
