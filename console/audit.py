"""Who changed what, when and why. Written in the same transaction as the change."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlite_utils import Database

from console.store import Store


def record(db: Database, *, at: float, actor: str, kind: str, target: str, summary: str,
           reason: str = "", detail: dict[str, Any] | None = None) -> None:
    db.execute(
        "INSERT INTO audit (at, actor, kind, target, summary, reason, detail) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [at, actor, kind, target, summary, reason, json.dumps(detail or {}, sort_keys=True)],
    )


@dataclass(frozen=True)
class Filter:
    actor: str = ""
    kind: str = ""
    text: str = ""
    limit: int = 200


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def query(store: Store, f: Filter) -> list[dict[str, Any]]:
    where, params = ["1 = 1"], []
    if f.actor:
        where.append("actor = ?")
        params.append(f.actor)
    if f.kind:
        # "breaker" matches breaker.trip and breaker.reset
        where.append("(kind = ? OR kind LIKE ? ESCAPE '\\')")
        params += [f.kind, _like(f.kind + ".")[1:]]
    if f.text:
        where.append("(summary LIKE ? ESCAPE '\\' OR target LIKE ? ESCAPE '\\' OR reason LIKE ? ESCAPE '\\' "
                     "OR detail LIKE ? ESCAPE '\\')")
        params += [_like(f.text)] * 4
    params.append(max(1, min(f.limit, 1000)))
    rows = store.query(f"SELECT * FROM audit WHERE {' AND '.join(where)} ORDER BY at DESC, id DESC LIMIT ?",
                       params)
    for row in rows:
        row["detail"] = json.loads(row["detail"] or "{}")
    return rows


def facets(store: Store) -> tuple[list[str], list[str]]:
    """The actors and kinds present, for the filter's drop-downs."""
    actors = [r["actor"] for r in store.query("SELECT DISTINCT actor FROM audit ORDER BY actor")]
    kinds = [r["kind"] for r in store.query("SELECT DISTINCT kind FROM audit ORDER BY kind")]
    return actors, kinds
