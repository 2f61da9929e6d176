"""The database holds the session key and password hashes: private file, private directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from console.store import Store


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_db_and_wal_files_0600_in_a_new_0700_directory(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        db = tmp_path / "var" / "sub" / "console.db"
        store = Store(db)
        store.setting_or_create("x", lambda: "y")
        store.query("SELECT 1")
        assert mode(tmp_path / "var") == 0o700 and mode(db.parent) == 0o700
        for name in ("console.db", "console.db-wal", "console.db-shm"):
            assert (db.parent / name).exists(), name
            assert mode(db.parent / name) == 0o600, name
        store.close()
    finally:
        os.umask(old)


def test_existing_loose_db_is_tightened_and_shared_dir_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    db = shared / "console.db"
    db.touch()
    os.chmod(db, 0o644)
    Store(db).close()
    assert mode(db) == 0o600
    assert mode(shared) == 0o755  # not ours to change (it could be /tmp)


def test_token_from_a_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from console.__main__ import build_parser
    from console.config import ConsoleConfig, read_secret_file

    secret = tmp_path / "token"
    secret.write_text("tok-from-file\n")
    monkeypatch.delenv("SLUICE_CONSOLE_TOKEN", raising=False)
    monkeypatch.setenv("SLUICE_CONSOLE_TOKEN_FILE", str(secret))
    assert ConsoleConfig.from_env("x.db", "p").api_token == "tok-from-file"
    monkeypatch.setenv("SLUICE_CONSOLE_TOKEN", "tok-from-env")
    assert ConsoleConfig.from_env("x.db", "p").api_token == "tok-from-env"
    args = build_parser().parse_args(["serve", "--api-token-file", str(secret)])
    assert read_secret_file(args.api_token_file) == "tok-from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret_file(tmp_path / "empty")


def test_the_demo_keeps_the_token_off_command_lines() -> None:
    demo = (Path(__file__).resolve().parents[2] / "bench" / "demo.py").read_text()
    stack = (Path(__file__).resolve().parents[2] / "tests" / "e2e" / "console_stack.py").read_text()
    for source in (demo, stack):
        assert '"--api-token"' not in source and '"--console-token"' not in source
    assert "SLUICE_CONSOLE_TOKEN" in demo and "--api-token-file" in stack
