"""The audit log, filterable by actor, kind and text."""

from __future__ import annotations

from flask import Blueprint, request

from console import audit
from console.views.common import region, sluice

bp = Blueprint("audit", __name__)


@bp.get("/audit")
def page() -> tuple[str, int]:
    store = sluice().store
    f = audit.Filter(actor=request.args.get("actor", "").strip(), kind=request.args.get("kind", "").strip(),
                     text=request.args.get("q", "").strip())
    actors, kinds = audit.facets(store)
    return region("audit.html", "_audit_rows.html", entries=audit.query(store, f), filter=f, actors=actors,
                  kinds=kinds)
