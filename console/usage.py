"""Usage history and budget spend, from the replicas' reports: stored, summed, exported.

Each report carries ``usage`` (``{"run", "rows"}``: cumulative counts per tenant, model
and UTC hour since that replica process started, extproc.runtime.usage_history) and
``budgets.periods`` (each budget period's settled total as the replica last saw it).
The console stores the usage increments against the replica's previous report of the
same run, so summing rows over any window is the usage, across replicas, whatever
reports were lost. For budget periods it keeps the highest settled total any replica
reported: the durable copy a replica (or Redis) that lost its count starts again from.

The console is the right home for both: it already owns the one SQLite file that
survives restarts of the data plane, and history is what its pages show. A replica's
report is at most a second old, so the durable copy lags the truth by about that.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlite_utils import Database

from console.store import Store

RETENTION_DAYS = 90  # ConsoleConfig.usage_retention_days
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "spend_nanos")
NANOS = 10**9


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        return None
    return int(v)


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _rows(usage: Any) -> tuple[str | None, dict[tuple[str, str, int], Mapping[str, Any]]]:
    u = _map(usage)
    run = u.get("run") if isinstance(u.get("run"), str) else None
    out: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    for r in u.get("rows") if isinstance(u.get("rows"), list) else []:
        r = _map(r)
        tenant, model, hour = r.get("tenant"), r.get("model"), _int(r.get("hour"))
        if isinstance(tenant, str) and isinstance(model, str) and hour is not None:
            out[(tenant, model, hour)] = r
    return run, out


def ingest(db: Database, status: Mapping[str, Any], prev: Mapping[str, Any], now: float,
           tenants: set[str] | None = None) -> None:
    """Store one report's usage increments and budget totals (inside ``live.ingest``'s
    transaction). ``tenants``: the policy's; rows of others are not stored."""
    run, rows = _rows(status.get("usage"))
    prev_run, prev_rows = _rows(prev.get("usage"))
    for key, r in rows.items():
        tenant, model, hour = key
        if tenants is not None and tenant not in tenants:
            continue
        before = prev_rows.get(key, {}) if prev_run == run else {}
        delta = {}
        for c in COUNTS:
            now_v, was = _int(r.get(c)) or 0, _int(before.get(c)) or 0
            delta[c] = now_v - was if now_v >= was else now_v
        refusals = {str(k): _int(v) or 0 for k, v in _map(r.get("refusals")).items()}
        old_refusals = {str(k): _int(v) or 0 for k, v in _map(before.get("refusals")).items()}
        refused = {k: (v - old_refusals.get(k, 0)) if v >= old_refusals.get(k, 0) else v
                   for k, v in refusals.items()}
        refused = {k: v for k, v in refused.items() if v > 0}
        if not any(delta.values()) and not refused:
            continue
        db.execute(
            "INSERT INTO usage_hourly (tenant, model, hour, requests, prompt_tokens, completion_tokens, "
            "cached_tokens, spend_nanos, refused) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (tenant, model, hour) DO UPDATE SET requests = requests + excluded.requests, "
            "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
            "completion_tokens = completion_tokens + excluded.completion_tokens, "
            "cached_tokens = cached_tokens + excluded.cached_tokens, "
            "spend_nanos = spend_nanos + excluded.spend_nanos, refused = refused + excluded.refused",
            [tenant, model, hour, *(delta[c] for c in COUNTS), sum(refused.values())])
        for reason, n in refused.items():
            db.execute("INSERT INTO usage_refusals (tenant, model, hour, reason, count) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT (tenant, model, hour, reason) DO UPDATE SET count = count + excluded.count",
                       [tenant, model, hour, reason, n])
    for p in _map(status.get("budgets")).get("periods") or []:
        p = _map(p)
        tenant, period = p.get("tenant"), p.get("key")
        start, end = p.get("start"), p.get("end")
        nums = [_int(p.get(k)) for k in ("settled_tokens", "settled_nanos", "used_tokens", "used_nanos")]
        if not (isinstance(tenant, str) and isinstance(period, str) and _int(start) is not None
                and _int(end) is not None and all(n is not None for n in nums)):
            continue
        if tenants is not None and tenant not in tenants:
            continue
        db.execute(
            "INSERT INTO budget_spend (tenant, period, start, end, settled_tokens, settled_nanos, used_tokens, "
            "used_nanos, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, period) DO UPDATE SET "
            "settled_tokens = MAX(settled_tokens, excluded.settled_tokens), "
            "settled_nanos = MAX(settled_nanos, excluded.settled_nanos), used_tokens = excluded.used_tokens, "
            "used_nanos = excluded.used_nanos, updated_at = excluded.updated_at",
            [tenant, period, float(start), float(end), *nums, now])


def prune(db: Database, now: float, retention_days: float = RETENTION_DAYS) -> None:
    cutoff = now - retention_days * 86400
    db.execute("DELETE FROM usage_hourly WHERE hour < ?", [cutoff])
    db.execute("DELETE FROM usage_refusals WHERE hour < ?", [cutoff])
    db.execute("DELETE FROM budget_spend WHERE end < ?", [cutoff])


def current_spend(store: Store, now: float) -> list[dict[str, Any]]:
    """The durable copy of every budget period not yet over (for the replicas' ``seed``)."""
    return store.query("SELECT tenant, period AS key, settled_tokens, settled_nanos FROM budget_spend "
                       "WHERE end > ? ORDER BY tenant, period", [now])


# -- reading ---------------------------------------------------------------------------
@dataclass
class Standing:
    """A tenant's current budget period, as the freshest report has it."""

    period: str
    start: float
    end: float
    settled_tokens: int
    settled_nanos: int
    used_tokens: int
    used_nanos: int


def _standing(row: Mapping[str, Any]) -> Standing:
    return Standing(row["period"], row["start"], row["end"], row["settled_tokens"], row["settled_nanos"],
                    max(row["used_tokens"], row["settled_tokens"]), max(row["used_nanos"], row["settled_nanos"]))


def standing(store: Store, tenant: str, now: float) -> Standing | None:
    row = store.one("SELECT * FROM budget_spend WHERE tenant = ? AND start <= ? AND end > ? "
                    "ORDER BY updated_at DESC LIMIT 1", [tenant, now, now])
    return None if row is None else _standing(row)


def standings(store: Store, now: float) -> dict[str, Standing]:
    """Every tenant's current period (the freshest, if a budget changed period), in one query."""
    out: dict[str, Standing] = {}
    for row in store.query("SELECT * FROM budget_spend WHERE start <= ? AND end > ? ORDER BY updated_at",
                           [now, now]):
        out[row["tenant"]] = _standing(row)
    return out


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spend_nanos: int = 0
    refused: int = 0
    refusals: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def hourly(store: Store, tenant: str, since: float) -> list[dict[str, Any]]:
    """The tenant's rows (all models) from ``since``, by hour."""
    return store.query("SELECT hour, SUM(requests) AS requests, SUM(prompt_tokens) AS prompt_tokens, "
                       "SUM(completion_tokens) AS completion_tokens, SUM(cached_tokens) AS cached_tokens, "
                       "SUM(spend_nanos) AS spend_nanos, SUM(refused) AS refused FROM usage_hourly "
                       "WHERE tenant = ? AND hour >= ? GROUP BY hour ORDER BY hour", [tenant, since])


def totals(store: Store, tenant: str, since: float) -> Totals:
    t = Totals()
    for r in hourly(store, tenant, since):
        for c in (*COUNTS, "refused"):
            setattr(t, c, getattr(t, c) + (r[c] or 0))
    for r in store.query("SELECT reason, SUM(count) AS n FROM usage_refusals WHERE tenant = ? AND hour >= ? "
                         "GROUP BY reason ORDER BY n DESC", [tenant, since]):
        t.refusals[r["reason"]] = r["n"]
    return t


def top_spenders(store: Store, since: float, limit: int = 5) -> list[dict[str, Any]]:
    return store.query("SELECT tenant, SUM(spend_nanos) AS spend_nanos, SUM(prompt_tokens + completion_tokens) "
                       "AS tokens, SUM(requests) AS requests, SUM(refused) AS refused FROM usage_hourly "
                       "WHERE hour >= ? GROUP BY tenant ORDER BY spend_nanos DESC, tokens DESC LIMIT ?",
                       [since, limit])


def first_hour(store: Store, since: float) -> float | None:
    row = store.one("SELECT MIN(hour) AS h FROM usage_hourly WHERE hour >= ?", [since])
    return None if row is None or row["h"] is None else float(row["h"])


def tokens_by_model(store: Store, since: float) -> dict[str, int]:
    """Tokens served per model since ``since`` (for the cost per million tokens served)."""
    return {r["model"]: r["tokens"] for r in store.query(
        "SELECT model, SUM(prompt_tokens + completion_tokens) AS tokens FROM usage_hourly WHERE hour >= ? "
        "GROUP BY model", [since])}


CSV_COLUMNS = ("hour_utc", "tenant", "model", "requests", "prompt_tokens", "completion_tokens", "cached_tokens",
               "spend", "refused", "refusals")


def csv_rows(store: Store, tenant: str, since: float) -> Iterable[list[Any]]:
    refusals: dict[tuple[str, int], list[str]] = {}
    for r in store.query("SELECT model, hour, reason, count FROM usage_refusals WHERE tenant = ? AND hour >= ? "
                         "ORDER BY reason", [tenant, since]):
        refusals.setdefault((r["model"], r["hour"]), []).append(f"{r['reason']}={r['count']}")
    for r in store.query("SELECT * FROM usage_hourly WHERE tenant = ? AND hour >= ? ORDER BY hour, model",
                         [tenant, since]):
        yield [hour_iso(r["hour"]), tenant, r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"],
               r["cached_tokens"], money(r["spend_nanos"]), r["refused"],
               ";".join(refusals.get((r["model"], r["hour"]), []))]


def csv_text(store: Store, tenant: str, since: float) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    w.writerows(csv_rows(store, tenant, since))
    return buf.getvalue()


def hour_iso(hour: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(hour, dt.UTC).strftime("%Y-%m-%dT%H:00Z")


def money(nanos: int | None, places: int = 6) -> str:
    """Nanos as a decimal amount of the currency (exact: integer arithmetic)."""
    n = int(nanos or 0)
    whole, frac = divmod(n, NANOS)
    return f"{whole}.{frac:09d}"[: len(str(whole)) + 1 + places]
