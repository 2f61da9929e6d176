"""Login throttling (per account, per address, Retry-After, refused before hashing, bounded
hashing), the audit of failed logins, and server-side sessions that logout, a password
change and a role change end."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient

from console import sessions, users
from tests.console.conftest import PASSWORDS, Console, csrf, text_of

COOKIE = "sluice_session"


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Counts password checks (the scrypt work): every call of check_password_hash."""
    calls: list[str] = []
    original = users.check_password_hash

    def counting(pwhash: str, password: str) -> bool:
        calls.append(password)
        return original(pwhash, password)

    monkeypatch.setattr(users, "check_password_hash", counting)
    yield calls


def attempt(c: Console, name: str, password: str, addr: str = "127.0.0.1",
            client: FlaskClient | None = None) -> Any:
    cl = client or c.client
    token = csrf(cl)
    return cl.post("/login", data={"name": name, "password": password, "csrf_token": token},
                   environ_base={"REMOTE_ADDR": addr})


def test_200_wrong_passwords_then_the_right_one_waits_for_the_throttle(console: Console,
                                                                         hashes: list[str]) -> None:
    statuses = [attempt(console, "olga", f"wrong-{i}").status_code for i in range(200)]
    free = console.sluice.throttle.free
    assert statuses[:free] == [401] * free
    assert set(statuses[free:]) == {429}
    assert len(hashes) == free  # throttled attempts were refused before any hashing
    r = attempt(console, "olga", PASSWORDS["olga"])
    assert r.status_code == 429
    wait = int(r.headers["Retry-After"])
    assert 1 <= wait <= console.sluice.throttle.max_delay_s
    assert f"try again in {wait} s" in text_of(r)
    assert 'name="password"' in r.get_data(as_text=True)  # the form, with the wait
    assert len(hashes) == free
    with console.client.session_transaction() as sess:
        assert "sid" not in sess
    console.clock.t += wait - 0.5
    assert attempt(console, "olga", PASSWORDS["olga"]).status_code == 429
    console.clock.t += 1
    r = attempt(console, "olga", PASSWORDS["olga"])
    assert r.status_code == 303
    assert console.client.get("/").status_code == 200
    # the audit shows who, from where and when; the flood of refusals is one row a minute
    failed = [a for a in console.audit_rows() if a["kind"] == "auth.login_failed"]
    assert len(failed) == free
    assert all(a["actor"] == "olga" and a["target"] == "127.0.0.1" and a["at"] for a in failed)
    throttled = [a for a in console.audit_rows() if a["kind"] == "auth.login_throttled"]
    assert 1 <= len(throttled) <= 2
    assert "auth.login_failed" in text_of(console.client.get("/audit"))


def test_backoff_doubles_with_each_failure_after_the_free_ones(console: Console) -> None:
    free = console.sluice.throttle.free
    waits = []
    for i in range(free + 4):
        r = attempt(console, "olga", "wrong")
        assert r.status_code == 401, i
        if i >= free - 1:
            waits.append(int(attempt(console, "olga", "wrong").headers["Retry-After"]))
            console.clock.t += waits[-1]
    assert waits == [1, 2, 4, 8, 16]


def test_success_clears_the_account_failures(console: Console) -> None:
    free = console.sluice.throttle.free
    for _ in range(free - 1):
        assert attempt(console, "olga", "wrong").status_code == 401
    assert attempt(console, "olga", PASSWORDS["olga"]).status_code == 303
    for _ in range(free - 1):
        assert attempt(console, "olga", "wrong").status_code == 401


def test_account_throttle_holds_across_addresses(console: Console) -> None:
    for i in range(console.sluice.throttle.free):
        assert attempt(console, "olga", "wrong", addr=f"10.0.0.{i}").status_code == 401
    assert attempt(console, "olga", PASSWORDS["olga"], addr="10.9.9.9").status_code == 429
    # other accounts are not locked by it
    assert attempt(console, "vic", PASSWORDS["vic"], addr="10.9.9.9").status_code == 303


def test_address_throttle_covers_every_name(console: Console) -> None:
    for i in range(console.sluice.throttle.addr_free):
        assert attempt(console, f"guess-{i}", "wrong", addr="10.6.6.6").status_code == 401
    r = attempt(console, "vic", PASSWORDS["vic"], addr="10.6.6.6")
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert attempt(console, "vic", PASSWORDS["vic"], addr="10.1.1.1").status_code == 303
    audit = [a for a in console.audit_rows() if a["kind"] == "auth.login_failed"]
    assert {a["target"] for a in audit} == {"10.6.6.6"} and "guess-3" in {a["actor"] for a in audit}


def test_concurrent_logins_hash_one_at_a_time_and_pages_stay_fast(console: Console,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    inside = threading.Event()
    release = threading.Event()
    active = [0]
    most = [0]
    original = users.check_password_hash

    def slow(pwhash: str, password: str) -> bool:
        active[0] += 1
        most[0] = max(most[0], active[0])
        inside.set()
        release.wait(10)
        active[0] -= 1
        return original(pwhash, password)

    viewer = console.login("vic", console.new_client())
    monkeypatch.setattr(users, "check_password_hash", slow)
    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(
        attempt(console, "olga", "wrong", addr="10.0.0.1", client=console.new_client()).status_code))
    first.start()
    try:
        assert inside.wait(10)
        for i in range(5):  # while one check runs, the others are turned away at once
            r = attempt(console, f"user{i}", "wrong", addr=f"10.0.1.{i}", client=console.new_client())
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert "busy" in text_of(r)
        assert viewer.get("/tenants").status_code == 200  # a page needs no hashing slot
    finally:
        release.set()
        first.join(10)
    assert results == [401] and most[0] == 1
    assert attempt(console, "vic", PASSWORDS["vic"], addr="10.0.2.1", client=console.new_client()).status_code == 303


def old_cookie(c: FlaskClient) -> Callable[[], FlaskClient]:
    """A client that replays ``c``'s current session cookie later."""
    cookie = c.get_cookie(COOKIE)
    assert cookie is not None
    value = cookie.value

    def replay() -> FlaskClient:
        other = c.application.test_client()
        other.set_cookie(COOKIE, value)
        return other
    return replay


def test_logout_ends_the_session_server_side(console: Console) -> None:
    c = console.login("olga")
    replay = old_cookie(c)
    assert replay().get("/").status_code == 200
    assert console.post("/logout", htmx=False).status_code == 303
    stale = replay()
    r = stale.get("/tenants")
    assert r.status_code == 302 and r.headers["Location"].startswith("/login")
    assert stale.get("/overview/backends", headers={"HX-Request": "true"}).status_code == 401
    assert console.sluice.store.query("SELECT * FROM sessions") == []


def test_sessions_store_only_a_hash_of_the_id(console: Console) -> None:
    c = console.login("olga")
    with c.session_transaction() as sess:
        sid = sess["sid"]
    rows = console.sluice.store.query("SELECT id, user_id FROM sessions")
    assert len(rows) == 1 and rows[0]["id"] != sid and len(rows[0]["id"]) == 64


def test_password_change_ends_the_other_sessions(console: Console) -> None:
    here = console.login("olga", console.new_client())
    elsewhere = console.login("olga", console.new_client())
    vic = console.login("vic", console.new_client())
    r = console.post("/account/password", {"current": PASSWORDS["olga"], "new": "brand-new-pass-1",
                                           "again": "brand-new-pass-1"}, htmx=False, client=here)
    assert r.status_code == 200 and "other sessions were logged out" in text_of(r)
    assert here.get("/").status_code == 200
    assert elsewhere.get("/").status_code == 302
    assert vic.get("/").status_code == 200
    assert attempt(console, "olga", PASSWORDS["olga"], client=console.new_client()).status_code == 401
    assert attempt(console, "olga", "brand-new-pass-1", client=console.new_client()).status_code == 303
    assert [a["actor"] for a in console.audit_rows() if a["kind"] == "auth.password_changed"] == ["olga"]


def test_password_change_needs_the_current_password(console: Console) -> None:
    c = console.login("olga", console.new_client())
    other = console.login("olga", console.new_client())
    r = console.post("/account/password", {"current": "not-it-at-all", "new": "brand-new-pass-1",
                                           "again": "brand-new-pass-1"}, htmx=False, client=c)
    assert r.status_code == 403
    assert other.get("/").status_code == 200


def test_role_change_ends_the_users_sessions(console: Console) -> None:
    vic = console.login("vic", console.new_client())
    olga = console.login("olga", console.new_client())
    users.set_role(console.sluice.store, "vic", "operator")
    assert vic.get("/").status_code == 302
    assert olga.get("/").status_code == 200
    # the CLI's create-user --replace (new password and role) does the same
    users.create(console.sluice.store, "olga", "another-pass-1", "viewer", replace=True, method="pbkdf2:sha256:1000")
    assert olga.get("/").status_code == 302
    uid = console.sluice.store.one("SELECT id FROM users WHERE name = 'olga'")["id"]  # type: ignore[index]
    assert sessions.count(console.sluice.store, uid) == 0


def test_session_expires_server_side_after_12_hours(console: Console) -> None:
    c = console.login("olga")
    console.clock.t += 11 * 3600
    assert c.get("/").status_code == 200
    console.clock.t += 2 * 3600
    assert c.get("/").status_code == 302
