"""Operator accounts: scrypt password hashes (werkzeug), two roles."""

from __future__ import annotations

import time
from dataclasses import dataclass

from werkzeug.security import check_password_hash, generate_password_hash

from console import sessions
from console.store import Store

ROLES = ("operator", "viewer")
# Checked against when the name is unknown, so a miss costs as much as a wrong password.
_DUMMY_HASH = generate_password_hash("not a password")


@dataclass(frozen=True)
class User:
    id: int
    name: str
    role: str

    @property
    def can_edit(self) -> bool:
        return self.role == "operator"


def create(store: Store, name: str, password: str, role: str, *, replace: bool = False,
           method: str = "scrypt") -> User:
    """``method`` is werkzeug's; tests pass a cheap one, everything else keeps scrypt."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if not name or len(name) > 64 or not name.isprintable():
        raise ValueError("name must be 1-64 printable characters")
    if len(password) < 8:
        raise ValueError("password must be at least 8 characters")
    hashed = generate_password_hash(password, method=method)
    with store.write() as db:
        exists = list(db.query("SELECT id FROM users WHERE name = ?", [name]))
        if exists and not replace:
            raise ValueError(f"user {name!r} already exists")
        if exists:
            db.execute("UPDATE users SET password_hash = ?, role = ? WHERE name = ?", [hashed, role, name])
            # A reset password or a new role: whoever is logged in as this user logs in again.
            sessions.end_others(db, exists[0]["id"])
        else:
            db.execute("INSERT INTO users (name, password_hash, role, created_at) VALUES (?, ?, ?, ?)",
                       [name, hashed, role, time.time()])
        row = next(db.query("SELECT id, name, role FROM users WHERE name = ?", [name]))
    return User(row["id"], row["name"], row["role"])


def authenticate(store: Store, name: str, password: str) -> User | None:
    row = store.one("SELECT id, name, role, password_hash FROM users WHERE name = ?", [name])
    if row is None:
        check_password_hash(_DUMMY_HASH, password)
        return None
    if not check_password_hash(row["password_hash"], password):
        return None
    return User(row["id"], row["name"], row["role"])


def get(store: Store, user_id: int) -> User | None:
    row = store.one("SELECT id, name, role FROM users WHERE id = ?", [user_id])
    return User(row["id"], row["name"], row["role"]) if row else None


def _check_password(password: str) -> None:
    if len(password) < 8:
        raise ValueError("password must be at least 8 characters")


def change_password(store: Store, user_id: int, password: str, *, keep_session: str | None = None,
                    method: str = "scrypt") -> None:
    """Set a new password and end the user's other sessions (``keep_session`` stays)."""
    _check_password(password)
    hashed = generate_password_hash(password, method=method)
    with store.write() as db:
        db.execute("UPDATE users SET password_hash = ? WHERE id = ?", [hashed, user_id])
        sessions.end_others(db, user_id, keep_session)


def set_role(store: Store, name: str, role: str) -> User:
    """Change a user's role; all of the user's sessions end."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    with store.write() as db:
        rows = list(db.query("SELECT id FROM users WHERE name = ?", [name]))
        if not rows:
            raise ValueError(f"no user {name!r}")
        db.execute("UPDATE users SET role = ? WHERE id = ?", [role, rows[0]["id"]])
        sessions.end_others(db, rows[0]["id"])
    return User(rows[0]["id"], name, role)


def verify(store: Store, user_id: int, password: str) -> bool:
    row = store.one("SELECT password_hash FROM users WHERE id = ?", [user_id])
    return row is not None and check_password_hash(row["password_hash"], password)
