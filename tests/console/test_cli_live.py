"""The console's CLI run while the console is up, as the docs say to: the running console keeps
its database (its -wal and -shm files stay, reads and writes keep working), and ``/healthz``
fails when the database does.

Closing any descriptor of a file drops every POSIX lock the process holds on it; a console
that opened and closed its database file after SQLite had it open lost its shared lock,
and the CLI's exit then deleted the -wal and -shm files under it ("disk I/O error").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from console.store import Store
from tests.console.conftest import TOKEN, MakeConsole, write_policy

ROOT = Path(__file__).resolve().parents[2]
SIDECARS = ("console.db-wal", "console.db-shm")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "console", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def create_user(db: Path, name: str, role: str = "viewer", password: str = "long-enough-1",
                *more: str) -> None:
    cli("create-user", name, "--role", role, "--password", password, "--db", str(db), *more)


def in_new_thread(store: Store, sql: str) -> list[dict[str, object]]:
    """A query on a fresh reader connection, as a waitress thread that has not read yet."""
    out: list[list[dict[str, object]]] = []
    t = threading.Thread(target=lambda: out.append(store.query(sql)))
    t.start()
    t.join()
    assert out, "the query raised"
    return out[0]


def test_create_user_beside_an_open_store_leaves_its_files_and_connections_working(
    tmp_path: Path,
) -> None:
    db = tmp_path / "var" / "console.db"
    store = Store(db)
    store.setting_or_create("first", lambda: "1")
    for i in range(3):
        create_user(db, f"user{i}")
        assert all((db.parent / name).exists() for name in SIDECARS), sorted(os.listdir(db.parent))
        with store.write() as w:
            w.execute("INSERT INTO settings (key, value) VALUES (?, ?)", [f"after{i}", str(i)])
        assert store.check() is None
    names = [r["name"] for r in in_new_thread(store, "SELECT name FROM users ORDER BY name")]
    assert names == ["user0", "user1", "user2"]
    assert store.setting("after2") == "2"


def test_healthz_fails_when_the_database_files_are_deleted_under_the_console(
    make_console: MakeConsole,
) -> None:
    c = make_console()
    assert c.client.get("/healthz").status_code == 200
    db = c.sluice.store.path
    # What the old Store did after connecting: open and close the file, dropping the
    # process's locks; the CLI's exit then deletes the -wal and -shm files.
    os.close(os.open(db, os.O_RDWR))
    create_user(db, "late")
    assert not any((db.parent / name).exists() for name in SIDECARS)
    r = c.client.get("/healthz")
    assert r.status_code == 503, r.text
    body = r.get_json()
    assert body["status"] == "failing" and "deleted or replaced" in body["problem"]


def test_healthz_fails_when_reads_fail(make_console: MakeConsole) -> None:
    c = make_console()
    with c.sluice.store.write() as w:
        w.execute("DROP TABLE migrations")
    r = c.client.get("/healthz")
    assert r.status_code == 503 and "database read failed" in r.get_json()["problem"]


# -- the real console (waitress) and the real CLI at once ---------------------------------


@pytest.fixture
def live_console(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    db = tmp_path / "var" / "console.db"
    policy = write_policy(tmp_path / "policies")
    serve = (f"serve --db {db} --policy {policy} --port 0 --api-token {TOKEN} --demo "
             "--demo-user olga --demo-password operator-pass-1").split()
    proc = subprocess.Popen([sys.executable, "-m", "console", *serve], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+)/", first)
        assert found, first + (proc.stdout.read() if proc.poll() is not None else "")
        yield found.group(1), db
    finally:
        proc.terminate()
        proc.wait(10)


def log_in(url: str, name: str, password: str) -> httpx.Client:
    c = httpx.Client(base_url=url, timeout=10)
    page = c.get("/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token
    r = c.post("/login", data={"name": name, "password": password, "csrf_token": token.group(1)})
    assert r.status_code == 303, r.text
    return c


def test_the_cli_against_a_live_console_then_the_console_still_reads_and_writes(
    live_console: tuple[str, Path],
) -> None:
    url, db = live_console
    assert (
        httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    )  # up once it printed its address
    olga = log_in(url, "olga", "operator-pass-1")
    assert olga.get("/").status_code == 200

    for i in range(3):
        create_user(db, f"ops{i}")
    create_user(db, "ops0", "operator", "long-enough-2", "--replace")
    assert all((db.parent / name).exists() for name in SIDECARS)

    # Writes through the console: a replica report, a login (a session row), a password change.
    report = {
        "policy_etag": None,
        "backends": {"sim": {"kv_usage": 0.25, "running": 2, "waiting": 0}},
    }
    api = httpx.post(
        f"{url}/api/v1/replicas/r1/status",
        json=report,
        timeout=10,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert api.status_code == 200, api.text
    ops0 = log_in(url, "ops0", "long-enough-2")  # the console sees the CLI's write
    statuses = [
        c.get(path).status_code
        for c in (olga, ops0)
        for path in ("/", "/tenants", "/tiers", "/breakers", "/audit", "/export", "/users")
    ]
    assert statuses == [200] * len(statuses)
    assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok"}
    assert "ops2" in olga.get("/users").text
    olga.close()
    ops0.close()
