"""What the replicas report: stored per replica, sampled per backend, summarised for pages.

Reports are read liberally: a missing or mistyped field is shown as "—", never a 500.
Rejection and degradation counters are cumulative per replica (they only grow while
the replica lives); the console stores their increments, so "the last 5 minutes" is
a sum over rows, and a restarted replica (counter went down) starts from zero.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from console import breaker_events, ttft, usage
from console.pool_views import (
    AffinityView,
    EndpointView,
    PoolView,
    endpoint_series_key,
    endpoint_views,
    pool_view,
)
from console.report_values import as_map, num
from console.store import Store

SAMPLE_KEEP_S = 3600.0
EVENT_KEEP_S = 7 * 86400.0


def _counters(value: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in as_map(value).items() if num(v) is not None}


def ingest(store: Store, replica: str, status: Mapping[str, Any], now: float,
           known: set[str] | None = None, tenants: set[str] | None = None) -> None:
    """Store a report; samples and breaker history only for the ``known`` backends (the
    policy's), so made-up backend names cost one stored report, not rows every second;
    usage history and budget spend only for the policy's ``tenants`` (console.usage)."""
    with store.write() as db:
        # Read inside the transaction: the increments are against exactly the previous report.
        prev_rows = list(db.query("SELECT status FROM replicas WHERE id = ?", [replica]))
        prev = as_map(json.loads(prev_rows[0]["status"])) if prev_rows else {}
        db.execute("INSERT INTO replicas (id, last_seen, status) VALUES (?, ?, ?) "
                   "ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen, status = excluded.status",
                   [replica, now, json.dumps(status)])
        bounds, prev_bounds = ttft.bounds_of(status), ttft.bounds_of(prev)
        for name, b in as_map(status.get("backends")).items():
            if known is not None and str(name) not in known:
                continue
            b = as_map(b)
            ttft.ingest_backend(db, now, replica, str(name), b.get("ttft_counts"),
                                as_map(as_map(prev.get("backends")).get(name)).get("ttft_counts"), bounds, prev_bounds)
            _sample(db, now, replica, str(name), b)
            for e in b.get("endpoints") if isinstance(b.get("endpoints"), list) else []:
                e = as_map(e)
                if isinstance(e.get("address"), str):  # a pool endpoint's own sparkline
                    _sample(db, now, replica, endpoint_series_key(str(name), e["address"]), e)
            before = as_map(as_map(prev.get("backends")).get(name))
            breaker_events.record(db, now, replica, str(name), b, before)
        usage.ingest(db, status, prev, now, tenants)
        prev_tenants = as_map(prev.get("tenants"))
        for tenant, t in as_map(status.get("tenants")).items():
            old = as_map(prev_tenants.get(tenant))
            for kind, key in (("rejection", "rejections"), ("degraded", "degraded")):
                before = _counters(old.get(key))
                for reason, count in _counters(as_map(t).get(key)).items():
                    prior = before.get(reason, 0)
                    delta = count - prior if count >= prior else count
                    if delta > 0:
                        db.execute("INSERT INTO tenant_events (at, replica, tenant, kind, reason, count) "
                                   "VALUES (?, ?, ?, ?, ?, ?)", [now, replica, str(tenant), kind, reason, delta])


def _sample(db: Any, now: float, replica: str, series: str, b: Mapping[str, Any]) -> None:
    db.execute("INSERT INTO kv_samples (at, replica, backend, kv_usage, running, waiting, scale) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)",
               [now, replica, series, num(b.get("kv_usage")), num(b.get("running")),
                num(b.get("waiting")), num(b.get("scale"))])


FORGET_AFTER_S = 3600.0
HIDE_AFTER_S = 300.0


def prune(store: Store, now: float, forget_after: float = FORGET_AFTER_S,
          usage_retention_days: float = usage.RETENTION_DAYS) -> None:
    """Old samples and events go, and so do replicas silent for ``forget_after`` seconds;
    usage history after ``usage_retention_days``."""
    with store.write() as db:
        usage.prune(db, now, usage_retention_days)
        db.execute("DELETE FROM replicas WHERE last_seen < ?", [now - forget_after])
        db.execute("DELETE FROM kv_samples WHERE at < ?", [now - SAMPLE_KEEP_S])
        db.execute("DELETE FROM tenant_events WHERE at < ?", [now - SAMPLE_KEEP_S])
        ttft.prune(db, now - SAMPLE_KEEP_S)
        db.execute("DELETE FROM breaker_events WHERE at < ?", [now - EVENT_KEEP_S])


@dataclass
class Replica:
    id: str
    last_seen: float
    age: float
    stale: bool
    status: Mapping[str, Any]

    @property
    def etag(self) -> str | None:
        value = self.status.get("policy_etag")
        return value if isinstance(value, str) else None


def replicas(store: Store, now: float, stale_after: float, hide_after: float = HIDE_AFTER_S) -> list[Replica]:
    """The replicas heard from within ``hide_after`` seconds (older ones wait to be pruned)."""
    out = []
    for r in store.query("SELECT id, last_seen, status FROM replicas WHERE last_seen >= ? ORDER BY id",
                         [now - hide_after]):
        try:
            status = as_map(json.loads(r["status"]))
        except ValueError:
            status = {}
        age = max(0.0, now - r["last_seen"])
        out.append(Replica(r["id"], r["last_seen"], age, age > stale_after, status))
    return out


@dataclass
class TierKvView:
    """One tier's KV share on a backend (docs/long-context.md): kept for it while it has demand,
    what it reserves now, and whether its demand holds the guarantee."""

    tier: str
    guaranteed_tokens: float | None = None
    burst_tokens: float | None = None
    reserved_tokens: float | None = None
    active: bool = False
    revocable: bool = False


def kv_tier_views(value: Any) -> list[TierKvView]:
    out = []
    for tier, t in as_map(as_map(value).get("tiers")).items():
        t = as_map(t)
        out.append(
            TierKvView(
                str(tier),
                num(t.get("guaranteed_tokens")),
                num(t.get("burst_tokens")),
                num(t.get("reserved_tokens")),
                t.get("active") is True,
                t.get("revocable") is True,
            )
        )
    return out


@dataclass
class BackendView:
    name: str
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    scale: float | None = None
    scrape_ok: bool | None = None
    metrics_state: str | None = None  # ok | no_series | problem | unreachable
    kv_source: str | None = None  # engine | reservations | saturated | none
    metrics_problem: Mapping[str, Any] | None = None  # {problem, error, hint} while metrics_url is unusable
    breakers: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # replica -> breaker
    slots: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # replica -> slots
    queue: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # replica -> queue
    endpoints: list[EndpointView] = field(default_factory=list)  # a pool's, from the freshest report
    pool: PoolView | None = None  # a pool's own line: its endpoints' sums, from the freshest report
    affinity: AffinityView | None = None
    kv_tiers: list[TierKvView] = field(
        default_factory=list
    )  # KV shares per tier, from the freshest report
    revoked: int = 0  # requests revoked for a higher tier, summed over the fresh reports
    revoked_work: int = 0  # the work those threw away (tokens)

    @property
    def breaker_states(self) -> list[str]:
        return sorted({str(b.get("state")) for b in self.breakers.values() if b.get("state")})


def backend_views(names: list[str], reps: list[Replica]) -> list[BackendView]:
    """Per backend of the policy, the freshest live report's gauges; breakers and slots per
    replica. Names the policy does not have are not shown (a page must not grow with them)."""
    fresh = sorted((r for r in reps if not r.stale), key=lambda r: r.last_seen)
    views = {n: BackendView(n) for n in names}
    for r in fresh:
        for name, b in as_map(r.status.get("backends")).items():
            v = views.get(str(name))
            if v is None:
                continue
            b = as_map(b)
            v.kv_usage, v.running, v.waiting = num(b.get("kv_usage")), num(b.get("running")), num(b.get("waiting"))
            v.scale = num(b.get("scale"))
            v.scrape_ok = b.get("scrape_ok") if isinstance(b.get("scrape_ok"), bool) else None
            v.metrics_state = b.get("metrics_state") if isinstance(b.get("metrics_state"), str) else None
            v.kv_source = b.get("kv_source") if isinstance(b.get("kv_source"), str) else None
            problem = as_map(b.get("metrics_problem"))
            v.metrics_problem = problem if problem.get("problem") else None
            v.breakers[r.id] = as_map(b.get("breaker"))
            v.slots[r.id] = as_map(b.get("slots"))
            v.queue[r.id] = as_map(b.get("queue"))
            v.endpoints = endpoint_views(b.get("endpoints"))
            v.pool = pool_view(b.get("pool"))
            shares = as_map(b.get("kv_shares"))
            if shares:
                v.kv_tiers = kv_tier_views(shares)
                rev = as_map(shares.get("revocation"))
                v.revoked += int(
                    sum(n for n in (num(x) for x in as_map(rev.get("revoked")).values()) if n)
                )
                v.revoked_work += int(
                    sum(n for n in (num(x) for x in as_map(rev.get("wasted_tokens")).values()) if n)
                )
            if isinstance(b.get("prefix_affinity"), Mapping):
                v.affinity = v.affinity or AffinityView()
                v.affinity.add(b["prefix_affinity"])
    return list(views.values())


def kv_series(store: Store, backend: str, since: float, bucket_s: float = 10.0) -> list[tuple[float, float]]:
    """(time, highest KV usage any replica saw) per bucket: the sparkline's points."""
    rows = store.query(
        "SELECT CAST(at / ? AS INTEGER) AS b, MAX(kv_usage) AS kv FROM kv_samples "
        "WHERE backend = ? AND at >= ? AND kv_usage IS NOT NULL GROUP BY b ORDER BY b",
        [bucket_s, backend, since])
    return [(r["b"] * bucket_s, r["kv"]) for r in rows]


@dataclass
class TenantLive:
    in_flight: int = 0
    tokens_remaining: float | None = None
    tpm: float | None = None
    replicas: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    degraded: dict[str, int] = field(default_factory=dict)

    @property
    def tpm_in_use(self) -> float | None:
        if self.tpm is None or self.tokens_remaining is None:
            return None
        return max(0.0, self.tpm - self.tokens_remaining)


def tenant_live(store: Store, reps: list[Replica], since: float) -> dict[str, TenantLive]:
    out: dict[str, TenantLive] = {}
    for r in reps:
        if r.stale:
            continue
        for name, t in as_map(r.status.get("tenants")).items():
            t = as_map(t)
            live = out.setdefault(str(name), TenantLive())
            live.replicas += 1
            live.in_flight += int(num(t.get("in_flight")) or 0)
            remaining, tpm = num(t.get("tokens_remaining")), num(t.get("tpm"))
            # Buckets are per replica unless shared through Redis: show the tightest.
            if remaining is not None:
                live.tokens_remaining = remaining if live.tokens_remaining is None else min(live.tokens_remaining,
                                                                                            remaining)
            if tpm is not None:
                live.tpm = tpm
    for row in store.query("SELECT tenant, kind, reason, SUM(count) AS n FROM tenant_events WHERE at >= ? "
                           "GROUP BY tenant, kind, reason ORDER BY tenant, kind, reason", [since]):
        live = out.setdefault(row["tenant"], TenantLive())
        (live.rejections if row["kind"] == "rejection" else live.degraded)[row["reason"]] = row["n"]
    return out
