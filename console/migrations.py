"""Schema changes, in order. Each runs once and is recorded in the ``migrations`` table.

Append new migrations; never edit or reorder one that has shipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlite_utils import Database

Migration = tuple[int, str, Callable[[Database], None]]


def _statements(db: Database, script: str) -> None:
    # Not executescript(): it commits first, which would split a migration in two.
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _initial(db: Database) -> None:
    _statements(db, """
    CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE users (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        password_hash TEXT NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('operator', 'viewer')),
        created_at REAL NOT NULL
    );
    -- Every distinct successful import of the policy files: the newest is the base layer.
    CREATE TABLE imports (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        sha TEXT NOT NULL,
        files TEXT NOT NULL,   -- JSON {file name: text}
        doc TEXT NOT NULL      -- JSON of the merged document
    );
    -- Operator edits layered over the base. Replaced or reverted rows stay, inactive.
    CREATE TABLE overrides (
        id INTEGER PRIMARY KEY,
        scope TEXT NOT NULL CHECK (scope IN ('tenant', 'tier', 'breaker')),
        target TEXT NOT NULL,
        field TEXT NOT NULL,
        value TEXT,            -- JSON, null removes the field
        base_value TEXT,       -- JSON of the base's value when the edit was made
        actor TEXT NOT NULL,
        at REAL NOT NULL,
        reason TEXT NOT NULL,
        active INTEGER NOT NULL DEFAULT 1
    );
    CREATE INDEX overrides_active ON overrides (active, scope, target, field);
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        actor TEXT NOT NULL,
        kind TEXT NOT NULL,
        target TEXT NOT NULL,
        summary TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX audit_at ON audit (at);
    CREATE TABLE replicas (
        id TEXT PRIMARY KEY,
        last_seen REAL NOT NULL,
        status TEXT NOT NULL
    );
    CREATE TABLE kv_samples (
        at REAL NOT NULL,
        replica TEXT NOT NULL,
        backend TEXT NOT NULL,
        kv_usage REAL,
        running REAL,
        waiting REAL,
        scale REAL
    );
    CREATE INDEX kv_samples_backend_at ON kv_samples (backend, at);
    -- Increments of the replicas' cumulative rejection/degradation counters.
    CREATE TABLE tenant_events (
        at REAL NOT NULL,
        replica TEXT NOT NULL,
        tenant TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('rejection', 'degraded')),
        reason TEXT NOT NULL,
        count INTEGER NOT NULL
    );
    CREATE INDEX tenant_events_at ON tenant_events (at);
    -- Breaker state changes seen between two reports of one replica.
    CREATE TABLE breaker_events (
        at REAL NOT NULL,
        replica TEXT NOT NULL,
        backend TEXT NOT NULL,
        from_state TEXT,
        to_state TEXT NOT NULL,
        trips INTEGER
    );
    CREATE INDEX breaker_events_at ON breaker_events (at);
    """)


def _sessions(db: Database) -> None:
    _statements(db, """
    -- Server-side sessions: the cookie carries a random id, the row holds its sha256.
    -- Logging out, a password change or a role change deletes rows, and a cookie without
    -- its row is logged out.
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,   -- sha256 hex of the id in the cookie
        user_id INTEGER NOT NULL REFERENCES users (id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        addr TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX sessions_user ON sessions (user_id);
    -- Failed password checks, per throttle key ("name:<n>" or "addr:<a>").
    CREATE TABLE login_failures (
        key TEXT NOT NULL,
        at REAL NOT NULL
    );
    CREATE INDEX login_failures_key_at ON login_failures (key, at)
    """)


def _tenant_overrides(db: Database) -> None:
    # SQLite cannot alter a CHECK constraint: rebuild the table with two more scopes,
    # "tenant_new" (a tenant created in the console) and "key" (an API key hash added
    # to, or with a null value removed from, a tenant).
    _statements(db, """
    CREATE TABLE overrides_new (
        id INTEGER PRIMARY KEY,
        scope TEXT NOT NULL CHECK (scope IN ('tenant', 'tier', 'breaker', 'tenant_new', 'key')),
        target TEXT NOT NULL,
        field TEXT NOT NULL,
        value TEXT,
        base_value TEXT,
        actor TEXT NOT NULL,
        at REAL NOT NULL,
        reason TEXT NOT NULL,
        active INTEGER NOT NULL DEFAULT 1
    );
    INSERT INTO overrides_new (id, scope, target, field, value, base_value, actor, at, reason, active)
        SELECT id, scope, target, field, value, base_value, actor, at, reason, active FROM overrides;
    DROP TABLE overrides;
    ALTER TABLE overrides_new RENAME TO overrides;
    CREATE INDEX overrides_active ON overrides (active, scope, target, field)
    """)


def _ttft_samples(db: Database) -> None:
    _statements(db, """
    -- Increments of a replica's cumulative TTFT bucket counts per backend and tier, one
    -- row per report that saw new requests: summed over a window, they give percentiles
    -- across replicas. bounds and counts are JSON lists (counts has one more: overflow).
    CREATE TABLE ttft_samples (
        at REAL NOT NULL,
        replica TEXT NOT NULL,
        backend TEXT NOT NULL,
        tier TEXT NOT NULL,
        bounds TEXT NOT NULL,
        counts TEXT NOT NULL
    );
    CREATE INDEX ttft_samples_backend_at ON ttft_samples (backend, at)
    """)


def _breaker_scopes(db: Database) -> None:
    _statements(db, """
    -- A pool endpoint's breaker (endpoint: host:port) or a tenant's own breaker on a
    -- backend (tenant), beside the backend's (both null).
    ALTER TABLE breaker_events ADD COLUMN endpoint TEXT;
    ALTER TABLE breaker_events ADD COLUMN tenant TEXT
    """)


def _usage(db: Database) -> None:
    _statements(db, """
    -- What each tenant used per model and UTC hour (the hour's start, epoch seconds): the
    -- increments of the replicas' cumulative counts (console.usage), kept for the
    -- configured retention. Refusals by reason in their own table.
    CREATE TABLE usage_hourly (
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,
        hour INTEGER NOT NULL,
        requests INTEGER NOT NULL DEFAULT 0,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        spend_nanos INTEGER NOT NULL DEFAULT 0,
        refused INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant, model, hour)
    );
    CREATE INDEX usage_hourly_hour ON usage_hourly (hour);
    CREATE TABLE usage_refusals (
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,
        hour INTEGER NOT NULL,
        reason TEXT NOT NULL,
        count INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant, model, hour, reason)
    );
    -- The durable copy of each budget period's spend: the highest settled total any replica
    -- reported (a replica, or Redis, that lost the count starts again from it).
    CREATE TABLE budget_spend (
        tenant TEXT NOT NULL,
        period TEXT NOT NULL,    -- e.g. day:Europe/Berlin:2025-03-10
        start REAL NOT NULL,
        end REAL NOT NULL,
        settled_tokens INTEGER NOT NULL DEFAULT 0,
        settled_nanos INTEGER NOT NULL DEFAULT 0,
        used_tokens INTEGER NOT NULL DEFAULT 0,
        used_nanos INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL,
        PRIMARY KEY (tenant, period)
    );
    CREATE INDEX budget_spend_end ON budget_spend (end)
    """)


MIGRATIONS: list[Migration] = [
    (1, "initial schema", _initial),
    (2, "server-side sessions and login throttling", _sessions),
    (3, "tenants and keys as overrides", _tenant_overrides),
    (4, "TTFT bucket increments per backend and tier", _ttft_samples),
    (5, "endpoint and tenant breakers in the breaker history", _breaker_scopes),
    (6, "usage history per tenant, model and hour; budget periods' spend", _usage),
]


def apply(db: Database, migrations: list[Migration] | None = None) -> list[int]:
    """Run the migrations not yet recorded; return the ids that ran."""
    db.execute("CREATE TABLE IF NOT EXISTS migrations (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
               "applied_at REAL NOT NULL)")
    done = {row["id"] for row in db.query("SELECT id FROM migrations")}
    ran = []
    for mid, name, fn in migrations if migrations is not None else MIGRATIONS:
        if mid in done:
            continue
        with db.atomic():
            fn(db)
            db.execute("INSERT INTO migrations (id, name, applied_at) VALUES (?, ?, ?)",
                       [mid, name, time.time()])
        ran.append(mid)
    return ran
