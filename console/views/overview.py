"""Overview: every backend's KV watermark, load, scale and breaker; the replicas."""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from console import live, sparkline, ttft
from console.pool_views import endpoint_series_key
from console.security import is_htmx
from console.views.breakers import backend_manual, manual_by_endpoint
from console.views.common import region, sluice, snapshot
from console.views.usage import spenders_context

bp = Blueprint("overview", __name__)
SPARK_WINDOW_S = 15 * 60


def _context(*, charts: bool = True) -> dict[str, Any]:
    """What the Overview renders; ``charts=False`` leaves out the KV and TTFT sparklines
    (queries per backend), which the replicas region polled every second does not show."""
    s = sluice()
    now = s.now()
    snap = snapshot()
    reps = live.replicas(s.store, now, s.config.stale_after_s, s.config.replica_hide_after_s)
    names = [b.name for b in snap.policy.backends] if snap else []
    backends = live.backend_views(names, reps)
    sparks = _sparks(s.store, backends, now) if charts else {}
    slos = {name: t.ttft_p99_ms for name, t in snap.policy.tiers.items()} if snap else {}
    ttfts = {b.name: _ttft_rows(s.store, b.name, now, slos) for b in backends} if charts else {}
    manual = backend_manual(snap.doc) if snap else {}
    return {"backends": backends, "sparks": sparks, "ttfts": ttfts, "replicas": reps, "manual": manual,
            "manual_endpoints": manual_by_endpoint(snap.doc) if snap else {},
            "etag": snap.etag if snap else None, "stale_after": s.config.stale_after_s}


def _sparks(store: Any, backends: list[live.BackendView], now: float) -> dict[str, Any]:
    """Each backend's KV sparkline, and each pool endpoint's (keyed ``backend@host:port``)."""
    since = now - SPARK_WINDOW_S
    out = {}
    for b in backends:
        what = "the pool's KV used over its capacity" if b.pool else "KV usage"
        out[b.name] = sparkline.svg(live.kv_series(store, b.name, since), since, now,
                                    label=f"{what} of {b.name}, last 15 min")
        for e in b.endpoints:
            key = endpoint_series_key(b.name, e.address)
            label = f"KV usage of {e.address} in {b.name}, last 15 min"
            out[key] = sparkline.svg(live.kv_series(store, key, since), since, now, width=120,
                                     height=24, label=label)
    return out


def _ttft_rows(store: Any, backend: str, now: float, slos: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tier: 15-minute TTFT p50 / p99 and a sparkline of the p99 per minute (dashed: the SLO)."""
    since = now - SPARK_WINDOW_S
    rows = []
    for t in ttft.summary(store, backend, since):
        slo = slos.get(t.tier)
        top = max([100.0, *(p * 1.1 for _, p in t.series), *([slo * 1.5] if slo else [])])
        spark = sparkline.svg(t.series, since, now, width=120, height=24, gap_s=90.0, top=top,
                              marks=[(slo, "#d9534f")] if slo else [],
                              label=f"TTFT p99 per minute of {t.tier} on {backend}, last 15 min")
        rows.append({"tier": t.tier, "n": t.n, "p50": t.p50_ms, "p99": t.p99_ms, "slo": slo, "spark": spark,
                     "over": bool(slo and t.p99_ms is not None and t.p99_ms > slo)})
    return rows


@bp.get("/")
def page() -> tuple[str, int]:
    return region("overview.html", "overview.html", **_context(), **spenders_context())


@bp.get("/overview/backends")
def backends() -> tuple[str, int]:
    return region("overview.html", "_backends.html", **_context())


@bp.get("/overview/replicas")
def replicas() -> tuple[str, int]:
    return region("overview.html", "_replicas.html", **_context(charts=not is_htmx()))
