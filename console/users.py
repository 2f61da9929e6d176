"""Operator accounts: scrypt password hashes (werkzeug), two roles.

Creating a user, replacing one's password and role, and changing a role are audited in the
same transaction, with who did it (a console user, or ``cli:<os user>``); a new password or
role ends the user's sessions. The CLI and the Users page go through the same functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from werkzeug.security import check_password_hash, generate_password_hash

from console import audit, sessions
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
           method: str = "scrypt", actor: str | None = None, now: float | None = None) -> User:
    """``method`` is werkzeug's; tests pass a cheap one, everything else keeps scrypt.
    ``actor``: who, for the audit log (None: not audited, the demo's own operator)."""
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
        at = time.time() if now is None else now
        if exists:
            db.execute("UPDATE users SET password_hash = ?, role = ? WHERE name = ?", [hashed, role, name])
            # A reset password or a new role: whoever is logged in as this user logs in again.
            sessions.end_others(db, exists[0]["id"])
        else:
            db.execute("INSERT INTO users (name, password_hash, role, created_at) VALUES (?, ?, ?, ?)",
                       [name, hashed, role, at])
        row = next(db.query("SELECT id, name, role FROM users WHERE name = ?", [name]))
        if actor is not None:
            what = f"password reset, role {role}; the user's sessions ended" if exists else \
                f"created as {role}"
            audit.record(db, at=at, actor=actor, kind="user.replace" if exists else "user.create",
                         target=name, summary=f"user {name!r} {what}", detail={"role": role})
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


def set_role(store: Store, name: str, role: str, *, actor: str | None = None,
             now: float | None = None, keep_an_operator: bool = False) -> User:
    """Change a user's role; all of the user's sessions end. ``keep_an_operator``: refuse to
    take the role from the last operator (the page's rule: the CLI is how to recover)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    with store.write() as db:
        rows = list(db.query("SELECT id, role FROM users WHERE name = ?", [name]))
        if not rows:
            raise ValueError(f"no user {name!r}")
        before = rows[0]["role"]
        if before == role:
            raise ValueError(f"{name!r} is already {role}")
        operators = next(db.query("SELECT COUNT(*) AS n FROM users WHERE role = 'operator'"))["n"]
        if keep_an_operator and before == "operator" and operators <= 1:
            raise ValueError(f"{name!r} is the last operator: make another user operator first")
        db.execute("UPDATE users SET role = ? WHERE id = ?", [role, rows[0]["id"]])
        ended = next(db.query("SELECT COUNT(*) AS n FROM sessions WHERE user_id = ?",
                              [rows[0]["id"]]))["n"]
        sessions.end_others(db, rows[0]["id"])
        if actor is not None:
            audit.record(db, at=time.time() if now is None else now, actor=actor, kind="user.role",
                         target=name,
                         summary=f"user {name!r}: {before} -> {role}; {ended} session(s) ended",
                         detail={"from": before, "to": role, "sessions_ended": ended})
    return User(rows[0]["id"], name, role)


@dataclass(frozen=True)
class Account:
    """A user as the Users page lists it."""

    name: str
    role: str
    created_at: float
    sessions: int


def accounts(store: Store) -> list[Account]:
    rows = store.query("SELECT u.name, u.role, u.created_at, COUNT(s.id) AS sessions FROM users u "
                       "LEFT JOIN sessions s ON s.user_id = u.id GROUP BY u.id ORDER BY u.name")
    return [Account(r["name"], r["role"], r["created_at"], r["sessions"]) for r in rows]


def verify(store: Store, user_id: int, password: str) -> bool:
    row = store.one("SELECT password_hash FROM users WHERE id = ?", [user_id])
    return row is not None and check_password_hash(row["password_hash"], password)
