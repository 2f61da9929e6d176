"""The Users page: operators create users and change roles with the CLI's audit and session
revocation; viewers see the list and change nothing; the last operator keeps the role."""

from __future__ import annotations

import re

from console import users
from tests.console.conftest import FAST_HASH, PASSWORDS, Console, MakeConsole, text_of


def users_region(c: Console) -> str:
    return text_of(c.client.get("/users"))


def test_an_operator_creates_a_user_who_can_log_in(operator: Console) -> None:
    page = text_of(operator.client.get("/users"))
    assert "olga operator" in page and "vic viewer" in page and "New user" in page
    r = operator.post(
        "/users",
        {"name": "nina", "role": "viewer", "password": "nina-pass-1", "again": "nina-pass-1"},
    )
    assert r.status_code == 200, r.get_data(as_text=True)
    assert "created viewer 'nina'" in text_of(r) and "nina viewer" in text_of(r)
    rows = [a for a in operator.audit_rows() if a["kind"] == "user.create"]
    assert [(a["actor"], a["target"]) for a in rows] == [("olga", "nina")]
    other = operator.new_client()
    other.get("/login")
    PASSWORDS["nina"] = "nina-pass-1"
    try:
        operator.login("nina", other)
    finally:
        del PASSWORDS["nina"]
    assert other.get("/users").status_code == 200


def test_bad_new_users_are_refused_next_to_the_field(operator: Console) -> None:
    cases = [
        (
            {"name": "x1", "role": "viewer", "password": "long-enough-1", "again": "long-enough-2"},
            "the passwords differ",
        ),
        (
            {"name": "x2", "role": "viewer", "password": "short", "again": "short"},
            "at least 8 characters",
        ),
        (
            {
                "name": "vic",
                "role": "viewer",
                "password": "long-enough-1",
                "again": "long-enough-1",
            },
            "already exists",
        ),
        (
            {"name": "x3", "role": "admin", "password": "long-enough-1", "again": "long-enough-1"},
            "role must be",
        ),
    ]
    for form, message in cases:
        r = operator.post("/users", form)
        assert r.status_code == 422 and message in text_of(r), (form, text_of(r))
    assert [a.name for a in users.accounts(operator.sluice.store)] == ["olga", "vic"]
    assert not [a for a in operator.audit_rows() if a["kind"].startswith("user.")]


def test_a_new_role_ends_the_users_sessions_and_is_audited(make_console: MakeConsole) -> None:
    c = make_console()
    vic = c.login("vic", c.new_client())
    assert vic.get("/users").status_code == 200
    c.login("olga")
    assert re.search(
        r"vic viewer \S+ \S+ UTC 1 ", users_region(c)
    )  # name, role, created, one session
    r = c.post("/users/vic/role", {"role": "operator"})
    assert r.status_code == 200 and "'vic' is now operator; their sessions ended" in text_of(r)
    assert vic.get("/users").status_code == 302  # logged out: logs in again with the new role
    (row,) = [a for a in c.audit_rows() if a["kind"] == "user.role"]
    assert (
        row["actor"] == "olga"
        and row["target"] == "vic"
        and "viewer -> operator; 1 session(s) ended" in row["summary"]
    )
    again = c.login("vic", c.new_client())
    assert "make viewer" in text_of(again.get("/users"))  # an operator now: the forms show


def test_the_last_operator_keeps_the_role(operator: Console) -> None:
    r = operator.post("/users/olga/role", {"role": "viewer"})
    assert r.status_code == 422 and "last operator" in text_of(r)
    assert users.get(operator.sluice.store, 1) is not None
    assert [a.role for a in users.accounts(operator.sluice.store) if a.name == "olga"] == [
        "operator"
    ]
    assert operator.post("/users/nobody/role", {"role": "viewer"}).status_code == 404
    assert operator.post("/users/vic/role", {"role": "viewer"}).status_code == 422  # already


def test_a_viewer_sees_the_list_without_forms(viewer: Console) -> None:
    page = viewer.client.get("/users").get_data(as_text=True)
    assert "olga" in page and "New user" not in page and "make operator" not in page


def test_the_cli_is_audited_like_the_page(console: Console) -> None:
    from console.__main__ import main

    db = console.sluice.store.path
    argv = f"create-user cli-made --role viewer --password long-enough-1 --db {db}".split()
    assert main(argv) == 0
    (row,) = [a for a in console.audit_rows() if a["kind"] == "user.create"]
    assert row["actor"].startswith("cli:") and row["target"] == "cli-made"
    users.create(
        console.sluice.store,
        "cli-made",
        "long-enough-2",
        "operator",
        replace=True,
        method=FAST_HASH,
        actor="cli:test",
    )
    assert [a["kind"] for a in console.audit_rows() if a["kind"].startswith("user.")] == [
        "user.create",
        "user.replace",
    ]
