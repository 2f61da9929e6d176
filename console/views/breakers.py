"""Breakers: trip, reset or clear by hand (reason required, optional expiry), state and history."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, redirect, request, url_for
from werkzeug.wrappers import Response

from console import audit, breaker_events, breaker_views, edits, live
from console.security import is_htmx, operator_required
from console.views.common import actor, reason_field, region, sluice, snapshot

bp = Blueprint("breakers", __name__)
HISTORY_S = 24 * 3600
MAX_MINUTES = 7 * 24 * 60


def _which(e: dict[str, Any]) -> str:
    """The breaker an event is about: a backend's, one endpoint's or one tenant's."""
    if e.get("endpoint"):
        return f"{e['backend']} endpoint {e['endpoint']}"
    if e.get("tenant"):
        return f"{e['backend']} tenant {e['tenant']}"
    return str(e["backend"])


def _history() -> list[dict[str, Any]]:
    s = sluice()
    since = s.now() - HISTORY_S
    items = [{"at": e["at"], "backend": _which(e), "who": f"replica {e['replica']}",
              "kind": "endpoint" if e.get("endpoint") else "tenant" if e.get("tenant") else
              "backend",
              "what": f"{e['from_state'] or '—'} → {e['to_state']}",
              "why": f"trips: {e['trips']}" if e["trips"] is not None else ""}
             for e in breaker_events.history(s.store, since)]
    for a in audit.query(s.store, audit.Filter(kind="breaker", limit=200)):
        if a["at"] >= since:
            endpoint = a["detail"].get("endpoint") if isinstance(a["detail"], dict) else None
            which = f"{a['target']} endpoint {endpoint}" if endpoint else a["target"]
            items.append({"at": a["at"], "backend": which, "who": a["actor"], "what": a["summary"],
                          "kind": "endpoint" if endpoint else "backend", "why": a["reason"]})
    return sorted(items, key=lambda i: i["at"], reverse=True)[:200]


def _context(*, history: bool = True, **extra: Any) -> dict[str, Any]:
    """What the breakers page renders; ``history=False`` leaves out the 24-hour history
    (two queries), which the state region polled every second does not show."""
    s = sluice()
    snap = snapshot()
    names = [b.name for b in snap.policy.backends] if snap else []
    reps = live.replicas(s.store, s.now(), s.config.stale_after_s, s.config.replica_hide_after_s)
    manual = backend_manual(snap.doc) if snap else {}
    tenant_rows, tenant_counts = breaker_views.tenant_breakers(names, reps)
    return {"names": names, "backends": live.backend_views(names, reps), "manual": manual, "now": s.now(),
            "manual_endpoints": manual_by_endpoint(snap.doc) if snap else {},
            "endpoint_breakers": breaker_views.endpoint_breakers(names, reps),
            "tenant_breakers": tenant_rows, "tenant_counts": tenant_counts,
            "history": _history() if history else [], "forms": {}, **extra}


def parse_form() -> tuple[str, str, float | None, dict[str, str], dict[str, list[str]]]:
    """A trip/reset/clear form: action, reason, minutes (blank: until cleared), the form
    to re-render, and the problems by field."""
    action = request.form.get("action", "")
    errors: dict[str, list[str]] = {}
    if action not in edits.BREAKER_ACTIONS:
        errors[""] = ["choose trip, reset or clear"]
    reason, problem = reason_field()
    if problem:
        errors["reason"] = [problem]
    raw = (request.form.get("minutes") or "").strip()
    minutes: float | None = None
    if raw:
        try:
            minutes = float(raw)
        except ValueError:
            errors["minutes"] = [f"expected a number of minutes, got {raw!r}"]
        else:
            if not 0 < minutes <= MAX_MINUTES:
                errors["minutes"] = [f"expiry must be between 0 and {MAX_MINUTES} minutes (blank: until cleared)"]
    return action, reason, minutes, {"reason": reason, "minutes": raw}, errors


def backend_manual(doc: dict[str, Any]) -> dict[str, Any]:
    """The served manual entries of backends' own breakers (not one endpoint's of a pool)."""
    return {b["backend"]: b for b in doc.get("breakers", []) if not b.get("endpoint")}


def manual_by_endpoint(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The served manual entries of single pool endpoints, by (backend, host:port)."""
    return {(b["backend"], b["endpoint"]): b for b in doc.get("breakers", []) if b.get("endpoint")}


@bp.get("/breakers")
def page() -> tuple[str, int]:
    return region("breakers.html", "breakers.html", **_context())


@bp.get("/breakers/state")
def state() -> tuple[str, int]:
    return region("breakers.html", "_breakers_state.html", **_context(history=not is_htmx()))


@bp.get("/breakers/history")
def history() -> tuple[str, int]:
    return region("breakers.html", "_breaker_history.html", **_context())


@bp.post("/breakers/<backend>")
@operator_required
def change(backend: str) -> Response | tuple[str, int]:
    snap = snapshot()
    if snap is None or backend not in [b.name for b in snap.policy.backends]:
        abort(404, description=f"no backend {backend!r}")
    action, reason, minutes, form, errors = parse_form()
    if not errors:
        result = edits.set_breaker(sluice().state, actor=actor(), backend=backend, action=action, reason=reason,
                                   minutes=minutes)
        if result.ok:
            if not is_htmx():
                return redirect(url_for("breakers.page"), code=303)
            done = {"trip": "tripped", "reset": "reset", "clear": "cleared"}[action]
            body, status = region("breakers.html", "_breaker_form.html",
                                  **_context(backend=backend, form={}, errors={}, done=done))
            return Response(body, status, headers={"HX-Trigger": "breaker-changed"})
        errors = {"": [p.message for p in result.problems]}
    forms = {backend: {"form": form, "errors": errors}}
    return region("breakers.html", "_breaker_form.html", 422,
                  **_context(backend=backend, form=form, errors=errors, forms=forms))
