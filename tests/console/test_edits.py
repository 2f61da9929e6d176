"""Operator edits: validated by the schema, shown in place when wrong, audited when right."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest

from tests.console.conftest import Console, text_of

TENANT = {"tier": "premium", "tpm": "", "rpm": "", "max_concurrency": "", "reason": "moving to premium"}
FREE = {"priority": "10", "tpm": "20000", "rpm": "60", "max_concurrency": "8", "burst_tokens": "",
        "guaranteed_slots": "", "max_queue_wait_ms": "", "max_queue_depth": "", "queue_weight": "",
        "reason": "tuning"}


def tenants(c: Console) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in c.policy()["tenants"]}


def errors_next_to(body: str, field: str) -> list[str]:
    """The messages rendered inside the field's own label."""
    found = re.findall(rf'<span class="error" role="alert" data-field="{field}">(.*?)</span>', body)
    return [html.unescape(m) for m in found]


def assert_nothing_changed(c: Console, etag: str, audit_count: int) -> None:
    assert c.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert len(c.audit_rows()) == audit_count
    assert c.sluice.store.query("SELECT * FROM overrides") == []


def test_move_tenant_to_another_tier(operator: Console) -> None:
    r = operator.post("/tenants/hobbyist", TENANT)
    assert r.status_code == 200, r.text
    body = r.get_data(as_text=True)
    assert body.startswith('<tr id="tenant-hobbyist">')  # the row alone, back in place of the form
    assert "premium" in body and "saved" in body and "override" in body
    assert tenants(operator)["hobbyist"]["tier"] == "premium"
    entry = operator.audit_rows()[-1]
    assert (entry["actor"], entry["kind"], entry["target"]) == ("olga", "tenant.update", "hobbyist")
    assert entry["summary"] == "tier: free → premium" and entry["reason"] == "moving to premium"
    ov = operator.sluice.store.query("SELECT * FROM overrides WHERE active = 1")
    assert [(o["target"], o["field"], o["value"], o["base_value"]) for o in ov] == [
        ("hobbyist", "tier", '"premium"', '"free"')]


def test_tenant_limits_set_and_unset(operator: Console) -> None:
    r = operator.post("/tenants/nightly-etl", {**TENANT, "tier": "batch", "tpm": "", "rpm": "30",
                                               "reason": "throttle etl"})
    assert r.status_code == 200, r.text
    t = tenants(operator)["nightly-etl"]
    assert "tpm" not in t and t["rpm"] == 30  # blank unsets: the tier's tpm applies again
    assert operator.audit_rows()[-1]["summary"] == "tpm: 100000 → —; rpm: — → 30"


def test_setting_the_files_value_back_removes_the_override(operator: Console) -> None:
    operator.post("/tenants/hobbyist", TENANT)
    operator.post("/tenants/hobbyist", {**TENANT, "tier": "free", "reason": "back"})
    assert operator.sluice.store.query("SELECT * FROM overrides WHERE active = 1") == []
    assert tenants(operator)["hobbyist"]["tier"] == "free"
    assert len([a for a in operator.audit_rows() if a["kind"] == "tenant.update"]) == 2


def test_unchanged_form_writes_nothing(operator: Console) -> None:
    before = len(operator.audit_rows())
    r = operator.post("/tenants/acme", {**TENANT, "reason": "nothing"})
    assert r.status_code == 200
    assert len(operator.audit_rows()) == before


@pytest.mark.parametrize("form,field,message", [
    ({"tier": "gold"}, "tier", "unknown tier 'gold'"),
    ({"tpm": "-5"}, "tpm", "must be >= 1, got -5"),
    ({"rpm": "0"}, "rpm", "must be >= 1, got 0"),
    ({"max_concurrency": "lots"}, "max_concurrency", "expected a whole number"),
    ({"reason": "  "}, "reason", "say why"),
    ({"tier": ""}, "tier", "choose a tier"),
])
def test_bad_tenant_input_is_shown_next_to_the_field(operator: Console, form: dict, field: str,
                                                     message: str) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    audit_count = len(operator.audit_rows())
    r = operator.post("/tenants/hobbyist", {**TENANT, **form})
    assert r.status_code == 422
    body = r.get_data(as_text=True)
    assert body.startswith('<tr id="tenant-hobbyist" class="editing">')  # the form again, in place
    assert any(message in m for m in errors_next_to(body, field)), body
    assert_nothing_changed(operator, etag, audit_count)


def test_bad_input_without_htmx_renders_the_page_with_the_form(operator: Console) -> None:
    r = operator.post("/tenants/hobbyist", {**TENANT, "tpm": "-1"}, htmx=False)
    assert r.status_code == 422
    body = r.get_data(as_text=True)
    assert body.startswith("<!doctype html>") and 'class="editing"' in body
    assert errors_next_to(body, "tpm")
    ok = operator.post("/tenants/hobbyist", TENANT, htmx=False)
    assert ok.status_code == 303 and ok.headers["Location"] == "/tenants"


def test_tier_edit(operator: Console) -> None:
    r = operator.post("/tiers/free", {**FREE, "tpm": "30000", "max_queue_wait_ms": "2500"})
    assert r.status_code == 200, r.text
    assert r.get_data(as_text=True).startswith('<tr id="tier-free">')
    tier = operator.policy()["tiers"]["free"]
    assert tier["tpm"] == 30000 and tier["max_queue_wait_ms"] == 2500
    entry = operator.audit_rows()[-1]
    assert entry["kind"] == "tier.update" and "tpm: 20000 → 30000" in entry["summary"]


@pytest.mark.parametrize("form,field,message", [
    ({"guaranteed_slots": "50"}, "guaranteed_slots", "tiers guarantee 74 slots, more than this backend's 64"),
    ({"tpm": "-100"}, "tpm", "must be >= 1"),
    ({"tpm": ""}, "tpm", "required field is missing"),
    ({"queue_weight": "1.5"}, "queue_weight", "expected a whole number"),
    ({"max_queue_depth": "-1"}, "max_queue_depth", "must be >= 0"),
])
def test_bad_tier_input_is_shown_next_to_the_field(operator: Console, form: dict, field: str,
                                                   message: str) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    audit_count = len(operator.audit_rows())
    r = operator.post("/tiers/free", {**FREE, **form})
    assert r.status_code == 422
    body = r.get_data(as_text=True)
    assert any(message in m for m in errors_next_to(body, field)), body
    assert_nothing_changed(operator, etag, audit_count)


def test_edit_forms_render(operator: Console) -> None:
    for path in ("/tenants/acme/edit", "/tiers/premium/edit"):
        r = operator.client.get(path, headers={"HX-Request": "true"})
        assert r.status_code == 200 and 'class="editing"' in r.get_data(as_text=True)
    body = operator.client.get("/tiers/premium/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert 'name="guaranteed_slots" value="24"' in body
    assert operator.client.get("/tenants/nobody/edit").status_code == 404


def test_trip_and_reset_breaker(operator: Console) -> None:
    r = operator.post("/breakers/sim", {"action": "trip", "reason": "GPU node draining", "minutes": "10"})
    assert r.status_code == 200, r.text
    assert r.headers["HX-Trigger"] == "breaker-changed"
    assert "breaker tripped" in text_of(r)
    [entry] = operator.policy()["breakers"]
    now = operator.clock.t
    assert entry == {"backend": "sim", "state": "open", "reason": "GPU node draining", "until": now + 600,
                     "by": "olga", "at": now}
    audit = operator.audit_rows()[-1]
    assert (audit["kind"], audit["target"], audit["reason"]) == ("breaker.trip", "sim", "GPU node draining")
    state = text_of(operator.client.get("/breakers/state", headers={"HX-Request": "true"}))
    assert "forced open" in state and "GPU node draining" in state
    operator.clock.t += 60
    r = operator.post("/breakers/sim", {"action": "reset", "reason": "node back"})
    assert r.status_code == 200
    [entry] = operator.policy()["breakers"]
    assert entry["state"] == "closed" and entry["until"] is None and entry["reason"] == "node back"
    state = text_of(operator.client.get("/breakers/state", headers={"HX-Request": "true"}))
    assert "forced closed" in state and "until cleared" in state
    r = operator.post("/breakers/sim", {"action": "clear", "reason": "automatic again"})
    assert r.status_code == 200 and "breaker cleared" in text_of(r)
    assert operator.policy()["breakers"] == []
    assert [a["kind"] for a in operator.audit_rows()[-3:]] == ["breaker.trip", "breaker.reset", "breaker.clear"]
    history = text_of(operator.client.get("/breakers/history", headers={"HX-Request": "true"}))
    assert "GPU node draining" in history and "node back" in history and "automatic again" in history
    state = text_of(operator.client.get("/breakers/state", headers={"HX-Request": "true"}))
    assert "the automatic breaker decides" in state


def test_clear_without_a_manual_override(operator: Console) -> None:
    audit_count = len(operator.audit_rows())
    r = operator.post("/breakers/sim", {"action": "clear", "reason": "x"})
    assert r.status_code == 422
    assert any("no manual override to clear" in m for m in errors_next_to(r.get_data(as_text=True), "form"))
    assert len(operator.audit_rows()) == audit_count


def test_breaker_expiry_drops_it_from_the_policy(operator: Console) -> None:
    operator.post("/breakers/sim", {"action": "trip", "reason": "short", "minutes": "1"})
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    assert len(operator.policy()["breakers"]) == 1
    operator.clock.t += 61
    r = operator.api("GET", "/api/v1/policy", headers={"If-None-Match": etag})
    assert r.status_code == 200 and r.get_json()["breakers"] == []


@pytest.mark.parametrize("form,field,message", [
    ({"action": "trip", "reason": ""}, "reason", "say why"),
    ({"action": "trip", "reason": "x", "minutes": "soon"}, "minutes", "expected a number of minutes"),
    ({"action": "trip", "reason": "x", "minutes": "-5"}, "minutes", "between 0 and"),
    ({"action": "explode", "reason": "x"}, "form", "choose trip, reset or clear"),
])
def test_bad_breaker_input(operator: Console, form: dict, field: str, message: str) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    audit_count = len(operator.audit_rows())
    r = operator.post("/breakers/sim", form)
    assert r.status_code == 422
    assert any(message in m for m in errors_next_to(r.get_data(as_text=True), field)), r.text
    assert_nothing_changed(operator, etag, audit_count)


def test_unknown_targets_are_404(operator: Console) -> None:
    assert operator.post("/breakers/nope", {"action": "trip", "reason": "x"}).status_code == 404
    assert operator.post("/tenants/nope", TENANT).status_code == 404
    assert operator.post("/tiers/nope", FREE).status_code == 404
    r = operator.post("/overrides/999/revert", {"reason": "x"})
    assert r.status_code == 404 and r.headers["HX-Retarget"] == "#flash"
