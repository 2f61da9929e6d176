"""GET /api/v1/policy: token, shape, ETag/304, long-poll."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

from console import validation
from tests.console.conftest import Console


def test_token_required(console: Console) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dGVzdDp0ZXN0"},
                    {"Authorization": "Bearer"}):
        r = console.client.get("/api/v1/policy", headers=headers)
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert "tenants" not in r.get_data(as_text=True)
    r = console.client.post("/api/v1/replicas/r1/status", json={"replica": "r1"})
    assert r.status_code == 401


def test_a_browser_session_does_not_open_the_api(operator: Console) -> None:
    assert operator.client.get("/api/v1/policy").status_code == 401


def test_policy_document(console: Console) -> None:
    r = console.api("GET", "/api/v1/policy")
    assert r.status_code == 200
    assert r.mimetype == "application/json"
    doc = r.get_json()
    assert set(doc) == {"gateway", "backends", "tiers", "tenants", "breakers"}
    assert doc["breakers"] == []
    assert [t["name"] for t in doc["tenants"]] == ["acme", "hobbyist", "nightly-etl"]
    assert doc["tiers"]["free"]["tpm"] == 20000
    # What replicas get validates with the data plane's own schema.
    validation.build(doc)


def test_etag_is_strong_hash_of_the_body(console: Console) -> None:
    r = console.api("GET", "/api/v1/policy")
    etag = r.headers["ETag"]
    assert etag.startswith('"') and etag.endswith('"') and not etag.startswith("W/")
    assert etag.strip('"') == hashlib.sha256(r.data).hexdigest()[:32]
    # canonical: sorted keys, no spaces
    assert r.data == json.dumps(r.get_json(), sort_keys=True, separators=(",", ":")).encode()


def test_if_none_match_gives_304(console: Console) -> None:
    etag = console.api("GET", "/api/v1/policy").headers["ETag"]
    for header in (etag, f'"other", {etag}', f"W/{etag}"):
        r = console.api("GET", "/api/v1/policy", headers={"If-None-Match": header})
        assert r.status_code == 304, header
        assert r.headers["ETag"] == etag
        assert r.data == b""
    r = console.api("GET", "/api/v1/policy", headers={"If-None-Match": '"stale"'})
    assert r.status_code == 200


def test_etag_changes_with_an_edit(operator: Console) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    r = operator.post("/tenants/hobbyist", {"tier": "premium", "tpm": "", "rpm": "", "max_concurrency": "",
                                            "reason": "upgrade"})
    assert r.status_code == 200, r.text
    r = operator.api("GET", "/api/v1/policy", headers={"If-None-Match": etag})
    assert r.status_code == 200 and r.headers["ETag"] != etag
    assert {t["name"]: t["tier"] for t in r.get_json()["tenants"]}["hobbyist"] == "premium"


def test_long_poll_returns_early_on_a_change(operator: Console) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    editor = operator.new_client()
    operator.login("olga", client=editor)

    def edit() -> None:
        time.sleep(0.3)
        operator.post("/tiers/free", {"priority": "10", "tpm": "25000", "rpm": "60", "max_concurrency": "8",
                                      "reason": "more for free"}, client=editor)

    t = threading.Thread(target=edit)
    started = time.monotonic()
    t.start()
    r = operator.api("GET", "/api/v1/policy?wait=10", headers={"If-None-Match": etag})
    took = time.monotonic() - started
    t.join()
    assert r.status_code == 200
    assert r.get_json()["tiers"]["free"]["tpm"] == 25000
    assert 0.25 < took < 2.0, took


def test_long_poll_notices_file_changes(console: Console) -> None:
    etag = console.api("GET", "/api/v1/policy").headers["ETag"]
    path = console.policy_dir / "gateway.yaml"

    def edit() -> None:
        time.sleep(0.2)
        path.write_text(path.read_text().replace("128", "256"))

    t = threading.Thread(target=edit)
    started = time.monotonic()
    t.start()
    r = console.api("GET", "/api/v1/policy?wait=5", headers={"If-None-Match": etag})
    t.join()
    assert r.status_code == 200 and r.get_json()["gateway"]["default_max_tokens"] == 256
    assert time.monotonic() - started < 2.0


def test_long_poll_times_out_with_304(console: Console) -> None:
    etag = console.api("GET", "/api/v1/policy").headers["ETag"]
    started = time.monotonic()
    r = console.api("GET", "/api/v1/policy?wait=0.4", headers={"If-None-Match": etag})
    assert r.status_code == 304
    assert 0.35 < time.monotonic() - started < 2.0


def test_long_poll_without_etag_answers_at_once(console: Console) -> None:
    started = time.monotonic()
    assert console.api("GET", "/api/v1/policy?wait=30").status_code == 200
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("wait", ["abc", "nan", "inf", "-inf"])
def test_bad_wait(console: Console, wait: str) -> None:
    assert console.api("GET", f"/api/v1/policy?wait={wait}").status_code == 400


def test_wait_is_capped(make_console) -> None:  # type: ignore[no-untyped-def]
    c = make_console(max_wait_s=0.3)
    etag = c.api("GET", "/api/v1/policy").headers["ETag"]
    started = time.monotonic()
    assert c.api("GET", "/api/v1/policy?wait=999", headers={"If-None-Match": etag}).status_code == 304
    assert time.monotonic() - started < 1.5
