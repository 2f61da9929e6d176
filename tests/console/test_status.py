"""Replica reports: stored, sampled, shown; stale replicas marked; liberal in what is accepted."""

from __future__ import annotations

import re
from typing import Any

import pytest

from console import live, sparkline
from tests.console.conftest import Console, text_of


def report(kv: float | None = 0.42, *, breaker: str = "closed", rejections: dict[str, int] | None = None,
           degraded: dict[str, int] | None = None, in_flight: int = 3, etag: str = '"x"') -> dict[str, Any]:
    return {
        "replica": "r1", "at": 1.0, "policy_etag": etag, "in_flight": in_flight,
        "ledger": {"outstanding": 0},
        "backends": {"sim": {
            "kv_usage": kv, "waiting": 2.0, "running": 17.0, "scale": 0.5, "scrape_ok": True,
            "breaker": {"state": breaker, "retry_after_s": None, "manual": None, "trips": 1},
            "slots": {"total": 64, "effective": 32, "in_use": 5, "by_tier": {"premium": 4, "free": 1}},
            "queue": {"depth": {"premium": 0, "free": 2}},
        }},
        "tenants": {"acme": {"tier": "premium", "in_flight": 4, "tokens_remaining": 150000, "tpm": 200000,
                             "rejections": rejections or {}, "degraded": degraded or {}}},
    }


def post_status(c: Console, body: Any, replica: str = "r1") -> Any:
    return c.api("POST", f"/api/v1/replicas/{replica}/status", json=body)


def test_status_is_stored_and_shown(operator: Console) -> None:
    r = post_status(operator, report(0.93))
    assert r.status_code == 200
    assert r.get_json()["policy_etag"] == operator.api("GET", "/api/v1/policy").headers["ETag"]
    row = operator.sluice.store.one("SELECT * FROM replicas WHERE id = 'r1'")
    assert row is not None and row["last_seen"] == operator.clock.t
    page = operator.client.get("/overview/backends", headers={"HX-Request": "true"})
    assert page.status_code == 200
    body = page.get_data(as_text=True)
    assert not body.lstrip().startswith("<!doctype")  # the partial alone
    assert 'hx-trigger="load delay:1s"' in body
    text = text_of(page)
    assert "93 %" in text and "17" in text and "0.50" in text and "closed" in text and "5/32" in text


def test_replicas_stale_after_five_seconds(operator: Console) -> None:
    post_status(operator, report(), "r1")
    operator.clock.t += 4
    post_status(operator, report(), "r2")
    operator.clock.t += 2  # r1: 6 s, r2: 2 s
    body = operator.client.get("/overview/replicas", headers={"HX-Request": "true"}).get_data(as_text=True)
    r1 = re.search(r'<tr id="replica-r1" class="(\w+)">(.*?)</tr>', body, re.S)
    r2 = re.search(r'<tr id="replica-r2" class="(\w+)">(.*?)</tr>', body, re.S)
    assert r1 and r1.group(1) == "stale" and "stale" in r1.group(2) and "6 s ago" in r1.group(2)
    assert r2 and r2.group(1) == "fresh" and "live" in r2.group(2)
    # A stale replica's gauges are not shown as the backend's current state.
    operator.clock.t += 10
    text = text_of(operator.client.get("/overview/backends", headers={"HX-Request": "true"}))
    assert "42 %" not in text


def test_policy_behind_marker(operator: Console) -> None:
    current = operator.api("GET", "/api/v1/policy").headers["ETag"]
    post_status(operator, report(etag=current), "r1")
    post_status(operator, report(etag='"old"'), "r2")
    body = operator.client.get("/overview/replicas", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert re.search(r'replica-r1.*?current', body, re.S)
    assert re.search(r'replica-r2.*?behind', body, re.S)


@pytest.mark.parametrize("body", [
    {},
    {"backends": None, "tenants": []},
    {"backends": {"sim": None}},
    {"backends": {"sim": {"kv_usage": "high", "breaker": "open", "slots": [], "queue": 3}}},
    {"backends": {"sim": {"kv_usage": None}}, "tenants": {"acme": {"rejections": {"tpm": "many"}}}},
    {"in_flight": "lots", "backends": {"sim": {"kv_usage": True, "scale": float("1e308")}}},
])
def test_liberal_in_what_is_accepted(operator: Console, body: dict[str, Any]) -> None:
    assert post_status(operator, body).status_code == 200
    for path in ("/", "/tenants", "/breakers"):
        r = operator.client.get(path)
        assert r.status_code == 200, path
    assert "—" in text_of(operator.client.get("/"))


def test_rejects_what_is_not_a_report(console: Console) -> None:
    assert console.api("POST", "/api/v1/replicas/r1/status", data="not json",
                       content_type="application/json").status_code == 400
    assert post_status(console, [1, 2]).status_code == 400
    assert post_status(console, {}, replica="bad id!").status_code in (400, 404)
    assert post_status(console, {}, replica="x" * 80).status_code == 400


def test_tenant_counters_become_recent_increments(operator: Console) -> None:
    post_status(operator, report(rejections={"tpm": 5}, degraded={"max_tokens_capped": 1}))
    operator.clock.t += 1
    post_status(operator, report(rejections={"tpm": 7, "rpm": 1}, degraded={"max_tokens_capped": 1}))
    operator.clock.t += 1
    post_status(operator, report(rejections={"tpm": 2}))  # replica restarted: counters start over
    rows = live.tenant_live(operator.sluice.store, [], operator.clock.t - 300)
    assert rows["acme"].rejections == {"tpm": 9, "rpm": 1}
    assert rows["acme"].degraded == {"max_tokens_capped": 1}
    text = text_of(operator.client.get("/tenants/live", headers={"HX-Request": "true"}))
    assert "tpm 9" in text and "rpm 1" in text and "max_tokens_capped 1" in text
    assert "50,000 / 200,000" in text  # TPM in use = tpm - tokens remaining
    operator.clock.t += 600
    assert "tpm 9" not in text_of(operator.client.get("/tenants/live", headers={"HX-Request": "true"}))


def test_breaker_transitions_become_history(operator: Console) -> None:
    post_status(operator, report(breaker="closed"))
    operator.clock.t += 1
    post_status(operator, report(breaker="open"))
    operator.clock.t += 1
    post_status(operator, report(breaker="open"))
    operator.clock.t += 1
    post_status(operator, report(breaker="half_open"))
    events = operator.sluice.store.query("SELECT from_state, to_state FROM breaker_events ORDER BY at")
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "closed"), ("closed", "open"), ("open", "half_open")]
    text = text_of(operator.client.get("/breakers/history", headers={"HX-Request": "true"}))
    assert "closed → open" in text and "open → half_open" in text and "replica r1" in text


def test_sparkline_from_samples(operator: Console) -> None:
    start = operator.clock.t
    for i in range(30):
        operator.clock.t = start + i * 10
        post_status(operator, report(0.5 + i / 100))
    body = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    svg = re.search(r"<svg class=\"sparkline\".*?</svg>", body, re.S)
    assert svg is not None
    points = re.search(r'<polyline points="([^"]+)"', svg.group(0))
    assert points is not None and len(points.group(1).split()) == 30
    assert "watermark" in svg.group(0)
    assert "<script" not in svg.group(0) and "style=" not in svg.group(0)


def test_sparkline_without_samples_and_with_gaps() -> None:
    assert "no samples" in sparkline.svg([], 0, 900)
    drawn = sparkline.svg([(0, 0.1), (10, 0.2), (500, 0.9), (510, 0.95)], 0, 900)
    assert drawn.count("<polyline") == 2
    assert 'y1="6.0"' in drawn  # the 85 % watermark on a 40 px high chart


def test_samples_kept_15_minutes_and_pruned_after_an_hour(operator: Console) -> None:
    store = operator.sluice.store
    start = operator.clock.t
    post_status(operator, report(0.3))
    operator.clock.t = start + 14 * 60
    post_status(operator, report(0.4))
    assert len(live.kv_series(store, "sim", operator.clock.t - 15 * 60)) == 2
    operator.clock.t = start + 61 * 60
    live.prune(store, operator.clock.t)
    assert [r["kv_usage"] for r in store.query("SELECT kv_usage FROM kv_samples")] == [0.4]


def test_unusable_metrics_show_as_a_banner_and_no_series_as_a_badge(operator: Console) -> None:
    body = report(None)
    body["backends"]["sim"].update(
        scrape_ok=False, metrics_state="problem", kv_source="reservations",
        metrics_problem={"problem": "no_engine_metrics", "error": "no vllm: metric in the exposition",
                         "hint": "no vllm: metric at all: vLLM runs with --disable-log-stats"})
    assert post_status(operator, body).status_code == 200
    page = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    banner = re.search(r'<p class="banner bad" id="metrics-problem-sim" role="alert">(.*?)</p>', page, re.S)
    assert banner, page
    assert "--disable-log-stats" in banner.group(1) and "no_engine_metrics" in banner.group(1)
    assert "metrics unusable" in page and "scrape failing" not in page
    assert "own KV reservations" in banner.group(1)
    # Without kv_capacity_tokens the replica counts it as saturated, and the banner says so.
    body["backends"]["sim"]["kv_source"] = "saturated"
    operator.clock.t += 1
    post_status(operator, body)
    page = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    banner = re.search(r'<p class="banner bad" id="metrics-problem-sim" role="alert">(.*?)</p>', page, re.S)
    assert banner and "counts as saturated" in banner.group(1) and "own KV reservations" not in banner.group(1)
    # Fixed: the banner goes; an engine that has not run a batch yet shows a softer badge.
    fixed = report(None)
    fixed["backends"]["sim"].update(metrics_state="no_series", kv_source="reservations", metrics_problem=None)
    operator.clock.t += 1
    post_status(operator, fixed)
    page = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert "metrics-problem-sim" not in page and "no series yet" in page and "metrics unusable" not in page
    # The full page carries the same region.
    assert "no series yet" in operator.client.get("/").get_data(as_text=True)


def test_pool_endpoints_show_under_their_backend(operator: Console) -> None:
    body = report(0.5)
    body["backends"]["sim"]["endpoints"] = [
        {"address": "10.0.0.1:8000", "usable": True, "draining": False, "kv_usage": 0.61, "kv_source": "engine",
         "metrics_reason": "ok", "waiting": 1, "breaker": {"state": "closed"},
         "slots": {"total": 32, "in_use": 7}, "kv": {"capacity_tokens": 32768, "reserved_tokens": 20000},
         "repicks": {"away": 0, "here": 3}},
        {"address": "10.0.0.2:8000", "usable": False, "draining": False, "kv_usage": None,
         "kv_source": "saturated", "metrics_reason": "unreachable", "waiting": None, "breaker": {"state": "open"},
         "slots": {"total": 16, "in_use": 0}, "kv": {"capacity_tokens": 16384, "reserved_tokens": 0},
         "repicks": {"away": 3, "here": 0}},
    ]
    assert post_status(operator, body).status_code == 200
    page = operator.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    first = page.split('id="endpoint-sim-10-0-0-1-8000"', 1)[1].split("</tr>", 1)[0]
    assert "10.0.0.1:8000" in first and "61%" in first.replace(" ", "") and "7/32" in first
    assert "20,000/32,768 reserved" in " ".join(re.sub(r"<[^>]+>", "", first).split())
    assert "closed" in first and "ejected" not in first
    second = page.split('id="endpoint-sim-10-0-0-2-8000"', 1)[1].split("</tr>", 1)[0]
    assert "ejected" in second and "open" in second and "unreachable" in second
    # Envoy re-picked 3 requests off the unreachable one onto the other (extproc.request.repick).
    assert "3 re-picked here" in first and "re-picked away" not in first
    assert "3 re-picked away" in second and "re-picked here" not in second
