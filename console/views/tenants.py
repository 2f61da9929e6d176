"""Tenants: tier and limits (editable inline), live usage from the replicas."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, redirect, request, url_for
from werkzeug.wrappers import Response

from console import edits, live, validation
from console.overrides import TENANT_FIELDS
from console.security import is_htmx, operator_required
from console.views.common import actor, reason_field, region, sluice, snapshot

bp = Blueprint("tenants", __name__)
LIVE_WINDOW_S = 5 * 60
NUMBERS = ("tpm", "rpm", "max_concurrency")


def _rows() -> list[dict[str, Any]]:
    snap = snapshot()
    if snap is None:
        return []
    overridden = {(o.target, o.field) for o in snap.overrides if o.scope == "tenant"}
    rows = []
    for t in snap.policy.tenants.values():
        rows.append({"name": t.name, "tenant": t, "limits": snap.policy.limits(t), "keys": len(t.key_hashes),
                     "overridden": {f for f in TENANT_FIELDS if (t.name, f) in overridden}})
    return rows


def _context(**extra: Any) -> dict[str, Any]:
    s = sluice()
    now = s.now()
    snap = snapshot()
    reps = live.replicas(s.store, now, s.config.stale_after_s)
    return {"rows": _rows(), "tiers": sorted(snap.policy.tiers) if snap else [],
            "live": live.tenant_live(s.store, reps, now - LIVE_WINDOW_S), "window_min": LIVE_WINDOW_S // 60,
            "editing": {}, **extra}


def _row(name: str) -> dict[str, Any]:
    for row in _rows():
        if row["name"] == name:
            return row
    abort(404, description=f"no tenant {name!r}")


@bp.get("/tenants")
def page() -> tuple[str, int]:
    return region("tenants.html", "tenants.html", **_context())


@bp.get("/tenants/live")
def live_region() -> tuple[str, int]:
    return region("tenants.html", "_tenants_live.html", **_context())


@bp.get("/tenants/<name>")
def row(name: str) -> tuple[str, int]:
    return region("tenants.html", "_tenant_row.html", **_context(row=_row(name)))


@bp.get("/tenants/<name>/edit")
@operator_required
def edit(name: str) -> tuple[str, int]:
    r = _row(name)
    form = {f: _show(getattr(r["tenant"], f)) for f in TENANT_FIELDS}
    editing = {name: {"form": form, "errors": {}}}
    return region("tenants.html", "_tenant_form.html", **_context(row=r, form=form, errors={}, editing=editing))


@bp.post("/tenants/<name>")
@operator_required
def save(name: str) -> Response | tuple[str, int]:
    r = _row(name)
    form = {f: (request.form.get(f) or "").strip() for f in TENANT_FIELDS}
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {"tier": form["tier"] or None}
    if not form["tier"]:
        errors["tier"] = ["choose a tier"]
    for f in NUMBERS:
        values[f], problem = validation.parse_int(form[f])
        if problem:
            errors[f] = [problem]
    reason, problem = reason_field()
    form["reason"] = reason
    if problem:
        errors["reason"] = [problem]
    if not errors:
        result = edits.set_fields(sluice().state, actor=actor(), scope="tenant", target=name, values=values,
                                  reason=reason)
        if result.ok:
            if not is_htmx():
                return redirect(url_for("tenants.page"), code=303)
            return region("tenants.html", "_tenant_row.html", **_context(row=_row(name), saved=bool(result.changed)))
        errors = validation.field_errors(result.problems, ("tenants", _index(name)), TENANT_FIELDS)
    editing = {name: {"form": form, "errors": errors}}
    return region("tenants.html", "_tenant_form.html", 422, **_context(row=r, form=form, errors=errors,
                                                                        editing=editing))


def _index(name: str) -> int:
    snap = snapshot()
    names = [t.get("name") for t in snap.doc.get("tenants", [])] if snap else []
    return names.index(name) if name in names else -1


def _show(value: Any) -> str:
    return "" if value is None else str(value)
