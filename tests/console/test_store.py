"""The SQLite file: WAL, one writer, registered migrations, first-start secrets."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlite_utils import Database

from console import migrations
from console.store import Store
from tests.console.conftest import Console, MakeConsole


def test_wal_and_migrations_recorded(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    assert store.reader.journal_mode == "wal"
    rows = store.query("SELECT id, name FROM migrations ORDER BY id")
    assert [(r["id"], r["name"]) for r in rows] == [(m[0], m[1]) for m in migrations.MIGRATIONS]
    assert {"users", "overrides", "audit", "replicas", "kv_samples", "imports"} <= set(store.reader.table_names())
    store.close()
    again = Store(tmp_path / "c.db")  # nothing runs twice
    assert len(again.query("SELECT * FROM migrations")) == len(migrations.MIGRATIONS)


def test_new_migration_runs_once_and_is_atomic(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    db = store._writer

    def add_column(d: Database) -> None:
        d.execute("ALTER TABLE users ADD COLUMN email TEXT")

    def broken(d: Database) -> None:
        d.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("boom")

    extra = [*migrations.MIGRATIONS, (100, "email", add_column)]
    assert migrations.apply(db, extra) == [100]
    assert migrations.apply(db, extra) == []
    with pytest.raises(RuntimeError):
        migrations.apply(db, [*extra, (101, "broken", broken)])
    assert "half_done" not in db.table_names()
    assert 101 not in {r["id"] for r in db.query("SELECT id FROM migrations")}
    store.close()


def test_concurrent_writes_go_through_one_writer(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")

    def write(n: int) -> None:
        for i in range(50):
            with store.write() as db:
                db.execute("INSERT INTO settings (key, value) VALUES (?, ?)", [f"k{n}-{i}", "v"])
            store.query("SELECT COUNT(*) FROM settings")

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.one("SELECT COUNT(*) AS n FROM settings") == {"n": 200}
    store.close()


def test_secret_and_token_created_once(make_console: MakeConsole, tmp_path: Path) -> None:
    first = make_console(secret_key=None, api_token=None)
    token = first.sluice.api_token
    secret = first.app.secret_key
    assert token and secret and len(token) > 20
    first.login("olga")
    cookie = first.client.get_cookie("sluice_session")
    assert cookie is not None
    db = first.sluice.config.db_path
    first.sluice.close()
    again = make_console(db=db, secret_key=None, api_token=None)
    assert again.sluice.api_token == token and again.app.secret_key == secret
    # The session survives a restart of the console.
    again.client.set_cookie("sluice_session", cookie.value)
    assert again.client.get("/").status_code == 200
    assert again.api("GET", "/api/v1/policy", token=token).status_code == 200


def test_env_token_wins(make_console: MakeConsole, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from console.config import ConsoleConfig

    monkeypatch.setenv("SLUICE_CONSOLE_TOKEN", "from-env")
    cfg = ConsoleConfig.from_env("x.db", "policies")
    assert cfg.api_token == "from-env"
    cfg = ConsoleConfig.from_env("x.db", "policies", api_token="from-flag")
    assert cfg.api_token == "from-flag"


def test_every_store_is_closed(console: Console, close_databases: list[Store]) -> None:
    assert console.sluice.store in close_databases
