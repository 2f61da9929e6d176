"""The console's SQLite file: one writer connection behind a lock, a reader per thread.

WAL lets readers (page renders, API long-polls) run while the writer commits, and a
single writer means no ``database is locked`` retries inside the app. Every statement
takes its values as parameters.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from console import migrations


def _private_dir(directory: Path) -> None:
    """Create the missing directories of ``directory`` 0700; an existing one is left alone
    (it may be shared, like /tmp), but the files in it are still private."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask


def _private_files(path: Path) -> None:
    """The database holds the session key and password hashes: 0600, and so do its WAL
    and shared-memory files (SQLite gives them the main file's mode; tightened here in
    case they were left over with another one).

    Only a missing file is opened here, and by path only otherwise: closing any
    descriptor of a file drops every POSIX lock this process holds on it, SQLite's
    included. Without its shared lock, the next other process to close the database
    (``create-user`` while the console runs) thinks it is the last, checkpoints and
    deletes the -wal and -shm files under the running console, which then answers
    ``disk I/O error`` and may lose writes."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        os.close(fd)
    for p in (path, *_sidecars(path)):
        try:
            if stat.S_IMODE(p.stat().st_mode) & 0o077:
                os.chmod(p, 0o600)
        except FileNotFoundError:
            continue


def _sidecars(path: Path) -> tuple[Path, Path]:
    """The WAL and shared-memory files SQLite keeps beside ``path`` while it is open."""
    return path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _connect(path: Path) -> Database:
    # check_same_thread off: close() runs on whichever thread shuts the app down.
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=5.0)
    db = Database(conn, execute_plugins=False)
    db.execute("PRAGMA busy_timeout = 5000")
    return db


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        _private_dir(self.path.parent)
        _private_files(self.path)
        self._write_lock = threading.RLock()
        self._writer = _connect(self.path)
        self._writer.enable_wal()
        self._writer.execute("PRAGMA synchronous = NORMAL")  # safe with WAL; fsync per checkpoint
        migrations.apply(self._writer)
        _private_files(self.path)  # the -wal and -shm files exist now
        # The writer stays open for the store's life, so SQLite keeps these very files
        # (it reuses the WAL, never replaces it): another inode means someone deleted them.
        self._sidecar_inodes = [_inode(p) for p in _sidecars(self.path)]
        self._local = threading.local()
        self._readers: list[Database] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        # Notified after every write that changes the effective policy (long-polls wait on it).
        self.changes = threading.Condition()
        self.generation = 0
        self.closing = False  # set at shutdown: long-polls answer now instead of holding a thread

    # -- reading -------------------------------------------------------------
    @property
    def reader(self) -> Database:
        db = getattr(self._local, "db", None)
        if db is None:
            if self._closed:
                raise RuntimeError("store is closed")
            db = _connect(self.path)
            self._local.db = db
            with self._readers_lock:
                self._readers.append(db)
        return db

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        return list(self.reader.query(sql, params))

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> dict[str, Any] | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    # -- writing -------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[Database]:
        """One transaction on the single writer connection."""
        with self._write_lock, self._writer.atomic():
            yield self._writer

    def policy_changed(self) -> None:
        with self.changes:
            self.generation += 1
            self.changes.notify_all()

    def wait_for_change(self, generation: int, timeout: float) -> int:
        with self.changes:
            self.changes.wait_for(lambda: self.generation != generation or self.closing,
                                  timeout=timeout)
            return self.generation

    def stop_waiting(self) -> None:
        """Release every long-poll (shutdown): the server then stops without waiting them out."""
        with self.changes:
            self.closing = True
            self.changes.notify_all()

    def check(self) -> str | None:
        """What is wrong with the database, or None: for ``/healthz``. A read through this
        thread's connection, and the WAL and shared-memory files on disk are still the
        ones this process writes through (not deleted or replaced under it)."""
        try:
            self.query("SELECT COUNT(*) AS n FROM migrations")
        except sqlite3.Error as exc:
            return f"database read failed: {exc}"
        for i, p in enumerate(_sidecars(self.path)):
            known, now = self._sidecar_inodes[i], _inode(p)
            if known is None:
                self._sidecar_inodes[i] = now  # not created yet at start
            elif now != known:
                return f"{p.name} was deleted or replaced while the console had the database open"
        return None

    # -- settings ------------------------------------------------------------
    def setting(self, key: str) -> str | None:
        row = self.one("SELECT value FROM settings WHERE key = ?", [key])
        return row["value"] if row else None

    def setting_or_create(self, key: str, make: Any) -> str:
        """Read a setting, storing ``make()`` first if absent (first start)."""
        with self.write() as db:
            rows = list(db.query("SELECT value FROM settings WHERE key = ?", [key]))
            if rows:
                return str(rows[0]["value"])
            value = str(make())
            db.execute("INSERT INTO settings (key, value) VALUES (?, ?)", [key, value])
            return value

    def close(self) -> None:
        self._closed = True
        with self._readers_lock:
            for db in self._readers:
                db.close()
            self._readers.clear()
        with self._write_lock:
            self._writer.close()
