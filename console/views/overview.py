"""Overview: every backend's KV watermark, load, scale and breaker; the replicas."""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from console import live, sparkline
from console.views.common import region, sluice, snapshot

bp = Blueprint("overview", __name__)
SPARK_WINDOW_S = 15 * 60


def _context() -> dict[str, Any]:
    s = sluice()
    now = s.now()
    snap = snapshot()
    reps = live.replicas(s.store, now, s.config.stale_after_s, s.config.replica_hide_after_s)
    names = [b.name for b in snap.policy.backends] if snap else []
    backends = live.backend_views(names, reps)
    sparks = {b.name: sparkline.svg(live.kv_series(s.store, b.name, now - SPARK_WINDOW_S), now - SPARK_WINDOW_S,
                                    now, label=f"KV usage of {b.name}, last 15 min") for b in backends}
    manual = {b["backend"]: b for b in snap.doc.get("breakers", [])} if snap else {}
    return {"backends": backends, "sparks": sparks, "replicas": reps, "manual": manual,
            "etag": snap.etag if snap else None, "stale_after": s.config.stale_after_s}


@bp.get("/")
def page() -> tuple[str, int]:
    return region("overview.html", "overview.html", **_context())


@bp.get("/overview/backends")
def backends() -> tuple[str, int]:
    return region("overview.html", "_backends.html", **_context())


@bp.get("/overview/replicas")
def replicas() -> tuple[str, int]:
    return region("overview.html", "_replicas.html", **_context())
