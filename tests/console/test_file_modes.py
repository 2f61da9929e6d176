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
