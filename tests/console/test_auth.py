"""Login, roles, CSRF, headers: nobody reads or changes anything they should not."""

from __future__ import annotations

import pytest

from console.security import CSP
from tests.console.conftest import PASSWORDS, Console, csrf, text_of

PAGES = ["/", "/tenants", "/tiers", "/breakers", "/audit", "/export", "/overview/backends", "/overview/replicas",
         "/tenants/live", "/breakers/state", "/breakers/history", "/export/policy.yaml", "/export/policy.diff",
         "/tenants/acme", "/tiers/free", "/users"]

# Every route that changes state, with a valid body: viewers must get 403 from each.
CHANGES = [
    ("/tenants/acme", {"tier": "free", "tpm": "", "rpm": "", "max_concurrency": "", "reason": "test"}),
    ("/tiers/free", {"tpm": "30000", "rpm": "60", "priority": "10", "max_concurrency": "8", "reason": "test"}),
    ("/breakers/sim", {"action": "trip", "reason": "test"}),
    ("/overrides/1/revert", {"reason": "test"}),
    ("/overrides/1/keep", {"reason": "test"}),
    ("/tenants", {"name": "newco", "tier": "free", "reason": "test"}),
    ("/tenants/acme/keys", {"reason": "test"}),
    ("/users", {"name": "newbie", "role": "operator", "password": "long-enough-1",
                "again": "long-enough-1"}),
    ("/users/vic/role", {"role": "operator"}),
]


@pytest.mark.parametrize("path", PAGES)
def test_unauthenticated_page_gets_login_not_data(console: Console, path: str) -> None:
    r = console.client.get(path)
    assert r.status_code == 302
    assert r.headers["Location"].startswith("/login?next=")
    body = r.get_data(as_text=True)
    assert "premium" not in body and "200000" not in body and "sha256" not in body
    page = console.client.get(r.headers["Location"])
    assert page.status_code == 200 and 'name="password"' in page.get_data(as_text=True)


def test_unauthenticated_htmx_gets_401_with_redirect(console: Console) -> None:
    r = console.client.get("/overview/backends", headers={"HX-Request": "true"})
    assert r.status_code == 401
    assert r.headers["HX-Redirect"] == "/login"
    assert "sim" not in r.get_data(as_text=True)


@pytest.mark.parametrize("path,data", CHANGES)
def test_unauthenticated_change_is_401_and_changes_nothing(console: Console, path: str, data: dict) -> None:
    etag = console.api("GET", "/api/v1/policy").headers["ETag"]
    r = console.post(path, data, htmx=False)
    assert r.status_code == 401
    assert console.api("GET", "/api/v1/policy").headers["ETag"] == etag


def test_login_and_logout(console: Console) -> None:
    c = console.login("olga")
    page = c.get("/")
    assert page.status_code == 200
    assert "olga" in text_of(page) and "operator" in text_of(page)
    r = console.post("/logout", htmx=False)
    assert r.status_code == 303 and r.headers["Location"] == "/login"
    assert c.get("/").status_code == 302


def test_wrong_password_and_unknown_user(console: Console) -> None:
    c = console.client
    c.get("/login")
    for name, password in (("olga", "nope-nope-nope"), ("mallory", PASSWORDS["olga"])):
        r = c.post("/login", data={"name": name, "password": password, "csrf_token": csrf(c)})
        assert r.status_code == 401
        assert "wrong name or password" in r.get_data(as_text=True)
        with c.session_transaction() as sess:
            assert "uid" not in sess
    assert c.get("/").status_code == 302


def test_login_requires_csrf(console: Console) -> None:
    c = console.client
    c.get("/login")
    r = c.post("/login", data={"name": "olga", "password": PASSWORDS["olga"]})
    assert r.status_code == 403
    with c.session_transaction() as sess:
        assert "uid" not in sess


def test_login_next_stays_on_site(console: Console) -> None:
    c = console.client
    c.get("/login")
    for target, expected in (("/tenants", "/tenants"), ("//evil.example/x", "/"), ("https://evil.example", "/")):
        r = c.post("/login", data={"name": "olga", "password": PASSWORDS["olga"], "csrf_token": csrf(c),
                                   "next": target})
        assert r.headers["Location"] == expected


def test_session_is_new_at_login(console: Console) -> None:
    c = console.client
    c.get("/login")
    before = csrf(c)
    console.login("olga")
    assert csrf(c) != before


@pytest.mark.parametrize("path,data", CHANGES)
def test_viewer_cannot_change_anything(viewer: Console, path: str, data: dict) -> None:
    etag = viewer.api("GET", "/api/v1/policy").headers["ETag"]
    audit_before = len(viewer.audit_rows())
    for htmx in (True, False):
        r = viewer.post(path, data, htmx=htmx)
        assert r.status_code == 403, (path, r.status_code)
    assert viewer.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert len(viewer.audit_rows()) == audit_before


def test_viewer_sees_pages_without_edit_controls(viewer: Console) -> None:
    for path in ("/tenants", "/tiers", "/breakers", "/export"):
        r = viewer.client.get(path)
        assert r.status_code == 200
        body = r.get_data(as_text=True)
        assert "/edit" not in body and "Trip (force open)" not in body
    assert viewer.client.get("/tenants/acme/edit").status_code == 403


@pytest.mark.parametrize("path,data", CHANGES[:3])
@pytest.mark.parametrize("htmx", [True, False])
@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_csrf_missing_or_wrong_is_rejected(operator: Console, path: str, data: dict, htmx: bool,
                                           token: str) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    r = operator.post(path, data, htmx=htmx, token=token)
    assert r.status_code == 403
    assert "CSRF" in r.get_data(as_text=True)
    assert operator.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert not [a for a in operator.audit_rows() if a["actor"] == "olga"]


def test_csrf_token_rendered_for_htmx_and_forms(operator: Console) -> None:
    body = operator.client.get("/tenants").get_data(as_text=True)
    token = csrf(operator.client)
    assert f'hx-headers=\'{{"X-CSRF-Token": "{token}"}}\'' in body
    form = operator.client.get("/tenants/acme/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert f'name="csrf_token" value="{token}"' in form


@pytest.mark.parametrize("path", ["/", "/login", "/tenants", "/api/v1/policy", "/static/htmx.min.js"])
def test_security_headers(operator: Console, path: str) -> None:
    r = operator.client.get(path)
    assert r.headers["Content-Security-Policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe" not in CSP
    assert r.headers["X-Frame-Options"] == "DENY"
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Referrer-Policy"] == "same-origin"


def test_session_cookie_flags(console: Console) -> None:
    r = console.client.get("/login")
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie


def test_templates_escape_input(operator: Console) -> None:
    r = operator.post("/tenants/acme", {"tier": "<script>alert(1)</script>", "tpm": "", "rpm": "",
                                        "max_concurrency": "", "reason": "<b>x</b>"})
    assert r.status_code == 422
    body = r.get_data(as_text=True)
    assert "<script>alert(1)</script>" not in body and "&lt;script&gt;" in body
    assert "<b>x</b>" not in body


def test_pages_have_no_inline_script_or_style(operator: Console) -> None:
    for path in ("/", "/tenants", "/tiers", "/breakers", "/audit", "/export"):
        body = operator.client.get(path).get_data(as_text=True)
        assert "<script>" not in body and "<style" not in body and " style=" not in body
        assert "hx-on" not in body and "onclick" not in body
