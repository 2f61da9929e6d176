"""One pool endpoint's breaker tripped, reset and cleared from the Overview's endpoint row."""

from __future__ import annotations

from typing import Any

import pytest

from tests.console.conftest import POLICY_FILES, Console, MakeConsole, text_of
from tests.console.test_edits import errors_next_to
from tests.console.test_status import post_status, report

A, B = "127.0.0.1:8000", "127.0.0.1:8002"
POOL = """\
backends:
  - name: sim
    max_concurrency: 64
    endpoints:
      - address: 127.0.0.1:8000
        metrics_url: http://127.0.0.1:8000/metrics
      - address: 127.0.0.1:8002
        metrics_url: http://127.0.0.1:8002/metrics
    models:
      - name: sim-llama-8b
        context_window: 4096
"""
URL = f"/overview/endpoints/sim/{B}/breaker"


@pytest.fixture
def pool(make_console: MakeConsole) -> Console:
    c = make_console(policy_files={**POLICY_FILES, "backends.yaml": POOL})
    c.login("olga")
    return c


def with_endpoints() -> dict[str, Any]:
    body = report(0.5)
    body["backends"]["sim"]["endpoints"] = [
        {"address": a, "usable": True, "draining": False, "kv_usage": 0.3, "kv_source": "engine",
         "metrics_reason": "ok", "waiting": 0, "breaker": {"state": "closed"},
         "slots": {"total": 32, "in_use": 0}, "kv": {"capacity_tokens": 32768, "reserved_tokens": 0}}
        for a in (A, B)]
    return body


def endpoint_row(c: Console, address: str) -> str:
    page = c.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    rid = "endpoint-sim-" + address.replace(":", "-").replace(".", "-")
    return page.split(f'id="{rid}"', 1)[1].split("</tr>", 1)[0]


def test_trip_reset_and_clear_one_endpoint(pool: Console) -> None:
    assert post_status(pool, with_endpoints()).status_code == 200
    row = endpoint_row(pool, B)
    assert f'hx-get="{URL}"' in row and "manual" not in row  # the row opens the form
    form = pool.client.get(URL, headers={"HX-Request": "true"})
    assert form.status_code == 200 and "automatic: the endpoint's own breaker decides" in text_of(form)

    r = pool.post(URL, {"action": "trip", "reason": "ECC errors on GPU 3", "minutes": "30"})
    assert r.status_code == 200, r.text
    assert r.headers["HX-Trigger"] == "breaker-changed" and "endpoint breaker tripped" in text_of(r)
    now = pool.clock.t
    [entry] = pool.policy()["breakers"]
    assert entry == {"backend": "sim", "endpoint": B, "state": "open", "reason": "ECC errors on GPU 3",
                     "until": now + 1800, "by": "olga", "at": now}
    audit = pool.audit_rows()[-1]
    assert (audit["kind"], audit["target"]) == ("breaker.trip", "sim") and B in audit["summary"]
    assert "manual open" in endpoint_row(pool, B) and "manual" not in endpoint_row(pool, A)
    # The backend's own row shows no manual badge: only that endpoint is forced.
    page = pool.client.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert "manual open" not in page.split('id="backend-sim"', 1)[1].split("</tr>", 1)[0]
    state = text_of(pool.client.get("/breakers/state", headers={"HX-Request": "true"}))
    assert "the automatic breaker decides" in state  # the backend's breaker stays automatic
    assert f"endpoint {B}: forced open by olga" in state and "ECC errors on GPU 3" in state

    # A backend trip beside it is its own entry; both are served.
    assert pool.post("/breakers/sim", {"action": "trip", "reason": "whole pool"}).status_code == 200
    assert {(e.get("endpoint"), e["state"]) for e in pool.policy()["breakers"]} == {(None, "open"), (B, "open")}
    assert pool.post("/breakers/sim", {"action": "clear", "reason": "pool back"}).status_code == 200
    [entry] = pool.policy()["breakers"]
    assert entry["endpoint"] == B  # clearing the backend's left the endpoint's trip alone

    r = pool.post(URL, {"action": "reset", "reason": "GPU replaced"})
    assert r.status_code == 200 and "endpoint breaker reset" in text_of(r)
    [entry] = pool.policy()["breakers"]
    assert (entry["state"], entry["until"]) == ("closed", None)
    assert "manual closed" in endpoint_row(pool, B)

    r = pool.post(URL, {"action": "clear", "reason": "automatic again"})
    assert r.status_code == 200 and "endpoint breaker cleared" in text_of(r)
    assert pool.policy()["breakers"] == []
    assert "manual" not in endpoint_row(pool, B)
    assert [a["kind"] for a in pool.audit_rows()[-3:]] == ["breaker.clear", "breaker.reset", "breaker.clear"]


def test_without_htmx_the_form_is_a_page_and_a_change_redirects(pool: Console) -> None:
    page = pool.client.get(URL)
    assert page.status_code == 200 and "<h1>Backends</h1>" in page.get_data(as_text=True)
    assert 'id="endpoint-breaker-form"' in page.get_data(as_text=True)
    r = pool.post(URL, {"action": "trip", "reason": "x"}, htmx=False)
    assert r.status_code == 303 and r.headers["Location"].endswith("/")


def test_an_endpoint_trip_expires(pool: Console) -> None:
    pool.post(URL, {"action": "trip", "reason": "short", "minutes": "1"})
    assert len(pool.policy()["breakers"]) == 1
    pool.clock.t += 61
    assert pool.policy()["breakers"] == []


def test_unknown_endpoint_or_backend_is_refused(pool: Console) -> None:
    audit_count = len(pool.audit_rows())
    assert pool.client.get("/overview/endpoints/sim/127.0.0.1:9/breaker").status_code == 404
    r = pool.post("/overview/endpoints/sim/127.0.0.1:9/breaker", {"action": "trip", "reason": "x"})
    assert r.status_code == 404 and "has no endpoint '127.0.0.1:9'" in text_of(r)
    assert pool.post("/overview/endpoints/nope/127.0.0.1:8000/breaker",
                     {"action": "trip", "reason": "x"}).status_code == 404
    assert len(pool.audit_rows()) == audit_count and pool.policy()["breakers"] == []


def test_bad_input_is_shown_next_to_the_field(pool: Console) -> None:
    r = pool.post(URL, {"action": "trip", "reason": ""})
    assert r.status_code == 422
    assert any("say why" in m for m in errors_next_to(r.get_data(as_text=True), "reason"))
    r = pool.post(URL, {"action": "clear", "reason": "x"})
    assert r.status_code == 422
    assert any("no manual override to clear" in m for m in errors_next_to(r.get_data(as_text=True), "form"))


def test_a_viewer_sees_the_badge_but_no_form(make_console: MakeConsole, pool: Console) -> None:
    pool.post(URL, {"action": "trip", "reason": "x"})
    post_status(pool, with_endpoints())
    viewer = pool.new_client()
    pool.login("vic", viewer)
    page = viewer.get("/overview/backends", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert "manual open" in page and "trip / reset" not in page
    assert pool.post(URL, {"action": "trip", "reason": "x"}, client=viewer).status_code == 403


def test_an_endpoint_removed_from_the_files_turns_its_trip_into_a_conflict(pool: Console) -> None:
    pool.post(URL, {"action": "trip", "reason": "bad GPU"})
    pool.write_file("backends.yaml", POOL.split("      - address: 127.0.0.1:8002")[0] + """\
    models:
      - name: sim-llama-8b
        context_window: 4096
""")
    assert pool.policy()["breakers"] == []  # the policy still builds, without the entry
    conflicts = pool.sluice.state.snapshot().conflicts
    assert [c.kind for c in conflicts] == ["missing"] and B in conflicts[0].message
