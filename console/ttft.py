"""Time to first token per backend and tier, from the replicas' cumulative bucket counts.

Each report carries ``ttft_bounds_ms`` (bucket upper bounds) and, per backend,
``ttft_counts`` ({tier: cumulative counts, one more than the bounds for overflow}). The
console stores each report's increments (a restarted replica, whose counts went down,
starts from zero), so a window's percentile is the sum of its rows' counts, across
replicas, interpolated within a bucket as Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlite_utils import Database

from console.store import Store

MAX_BUCKETS = 64


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not value or len(value) > MAX_BUCKETS + 1:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in value):
        return None
    return [int(v) for v in value]


def bounds_of(status: Mapping[str, Any]) -> list[float] | None:
    b = status.get("ttft_bounds_ms")
    if not isinstance(b, list) or not 0 < len(b) <= MAX_BUCKETS:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in b):
        return None
    return [float(v) for v in b] if all(x < y for x, y in zip(b, b[1:], strict=False)) else None


def ingest_backend(db: Database, now: float, replica: str, backend: str, counts: Any, prev_counts: Any,
                   bounds: list[float] | None, prev_bounds: list[float] | None) -> None:
    """Store this report's increments for one backend (rows only for tiers with new requests)."""
    if bounds is None or not isinstance(counts, Mapping):
        return
    prev = prev_counts if isinstance(prev_counts, Mapping) and prev_bounds == bounds else {}
    for tier, raw in counts.items():
        now_c = _ints(raw)
        if now_c is None or len(now_c) != len(bounds) + 1:
            continue
        before = _ints(prev.get(tier))
        if before is None or len(before) != len(now_c) or any(a < b for a, b in zip(now_c, before, strict=True)):
            before = [0] * len(now_c)  # first report, or the replica restarted
        delta = [a - b for a, b in zip(now_c, before, strict=True)]
        if any(delta):
            db.execute(
                "INSERT INTO ttft_samples (at, replica, backend, tier, bounds, counts) VALUES (?, ?, ?, ?, ?, ?)",
                [now, replica, backend, str(tier), json.dumps(bounds), json.dumps(delta)],
            )


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The q-quantile in ms, linear within its bucket; the last bound when it overflows."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * (rank - seen) / c
        seen += c
    return bounds[-1]


@dataclass
class TierTtft:
    tier: str
    n: int
    p50_ms: float | None
    p99_ms: float | None
    series: list[tuple[float, float]]  # (bucket start, p99 ms) per bucket_s


def summary(store: Store, backend: str, since: float, bucket_s: float = 60.0) -> list[TierTtft]:
    """Per tier over [since, now]: request count, p50 / p99, and a p99 per ``bucket_s``."""
    rows = store.query("SELECT at, tier, bounds, counts FROM ttft_samples WHERE backend = ? AND at >= ? "
                       "ORDER BY at", [backend, since])
    by_tier: dict[str, tuple[list[float], list[int], dict[int, list[int]]]] = {}
    for r in rows:
        try:
            bounds, counts = json.loads(r["bounds"]), json.loads(r["counts"])
        except ValueError:
            continue
        entry = by_tier.get(r["tier"])
        if entry is None or entry[0] != bounds:
            # Bounds changed (a newer replica): the newest bounds win, older rows drop out.
            entry = by_tier[r["tier"]] = (bounds, [0] * len(counts), {})
        if len(counts) != len(entry[1]):
            continue
        for i, c in enumerate(counts):
            entry[1][i] += c
        per = entry[2].setdefault(int(r["at"] // bucket_s), [0] * len(counts))
        for i, c in enumerate(counts):
            per[i] += c
    out = []
    for tier in sorted(by_tier):
        bounds, total, per = by_tier[tier]
        series = [(b * bucket_s, p) for b, c in sorted(per.items()) if (p := quantile(bounds, c, 0.99)) is not None]
        out.append(TierTtft(tier, sum(total), quantile(bounds, total, 0.5), quantile(bounds, total, 0.99), series))
    return out


def prune(db: Database, before: float) -> None:
    db.execute("DELETE FROM ttft_samples WHERE at < ?", [before])
