"""Server-side sessions: the signed cookie carries a random id; the row in SQLite is the session.

Logging out deletes the row, so the old cookie is logged out even though its signature
is still good; a password or role change deletes the user's other rows. The table
holds the id's sha256, not the id, so a copy of the database does not log anyone in.
"""

from __future__ import annotations

import hashlib
import secrets

from console.store import Store


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(store: Store, user_id: int, addr: str, now: float) -> str:
    token = secrets.token_urlsafe(32)
    with store.write() as db:
        db.execute("INSERT INTO sessions (id, user_id, created_at, addr) VALUES (?, ?, ?, ?)",
                   [_digest(token), user_id, now, addr[:64]])
    return token


def user_of(store: Store, token: str, now: float, lifetime_s: float) -> int | None:
    """The user a live session belongs to; expired or ended sessions have none."""
    row = store.one("SELECT user_id, created_at FROM sessions WHERE id = ?", [_digest(token)])
    if row is None or row["created_at"] + lifetime_s < now:
        return None
    return int(row["user_id"])


def end(store: Store, token: str) -> None:
    with store.write() as db:
        db.execute("DELETE FROM sessions WHERE id = ?", [_digest(token)])


def end_others(db: object, user_id: int, keep: str | None = None) -> None:
    """Every session of ``user_id`` but ``keep``; ``db`` is an open write transaction."""
    db.execute("DELETE FROM sessions WHERE user_id = ? AND id != ?",  # type: ignore[attr-defined]
               [user_id, _digest(keep) if keep else ""])


def prune(store: Store, now: float, lifetime_s: float) -> None:
    with store.write() as db:
        db.execute("DELETE FROM sessions WHERE created_at < ?", [now - lifetime_s])


def count(store: Store, user_id: int) -> int:
    row = store.one("SELECT COUNT(*) AS n FROM sessions WHERE user_id = ?", [user_id])
    return int(row["n"]) if row else 0
