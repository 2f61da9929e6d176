"""Tiers: every field the schema gives a tier, the numeric ones editable inline."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flask import Blueprint, abort, redirect, request, url_for
from werkzeug.wrappers import Response

from console import edits, validation
from console.overrides import editable_tier_fields, get_field, tier_fields
from console.security import is_htmx, operator_required
from console.views.common import actor, reason_field, region, sluice, snapshot

bp = Blueprint("tiers", __name__)
# A tier's guaranteed slots are checked against every backend's budget.
FALLBACK = {("backends", "*", "max_concurrency"): "guaranteed_slots"}


def _show(value: Any) -> str:
    if value is None:
        return ""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Nested settings (degrade): only what differs from the schema's defaults.
        try:
            defaults: Any = type(value)()
        except TypeError:
            defaults = None
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                   if defaults is None or getattr(value, f.name) != getattr(defaults, f.name)}
        return ", ".join(f"{k}={v}" for k, v in changed.items())
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, default=str)
    return str(value)


def _rows() -> list[dict[str, Any]]:
    snap = snapshot()
    if snap is None:
        return []
    overridden = {(o.target, o.field) for o in snap.overrides if o.scope == "tier"}
    rows = []
    for name, tier in snap.policy.tiers.items():
        in_doc = snap.doc["tiers"].get(name, {})
        rows.append({
            "name": name,
            "values": {f: getattr(tier, f, None) for f in tier_fields()},
            "set": {f for f in tier_fields() if f in in_doc},
            "overridden": {f for f in tier_fields() if (name, f) in overridden},
            "tenants": sum(1 for t in snap.policy.tenants.values() if t.tier == name),
        })
    return rows


def _budget() -> dict[str, Any]:
    snap = snapshot()
    if snap is None:
        return {}
    guaranteed = sum(t.guaranteed_slots for t in snap.policy.tiers.values())
    return {"guaranteed": guaranteed,
            "backends": [(b.name, b.max_concurrency) for b in snap.policy.backends]}


def _context(**extra: Any) -> dict[str, Any]:
    editable = editable_tier_fields()
    readonly = [f for f in tier_fields() if not any(e == f or e.startswith(f + ".") for e in editable)]
    return {"rows": _rows(), "fields": tier_fields(), "editable": editable, "readonly": readonly,
            "budget": _budget(), "show": _show, "editing": {}, **extra}


def _row(name: str) -> dict[str, Any]:
    for row in _rows():
        if row["name"] == name:
            return row
    abort(404, description=f"no tier {name!r}")


@bp.get("/tiers")
def page() -> tuple[str, int]:
    return region("tiers.html", "tiers.html", **_context())


@bp.get("/tiers/<name>")
def row(name: str) -> tuple[str, int]:
    return region("tiers.html", "_tier_row.html", **_context(row=_row(name)))


@bp.get("/tiers/<name>/edit")
@operator_required
def edit(name: str) -> tuple[str, int]:
    r = _row(name)
    snap = snapshot()
    in_doc = snap.doc["tiers"].get(name, {}) if snap else {}
    form = {f: _show(get_field(in_doc, f)) for f in editable_tier_fields()}
    return region("tiers.html", "_tier_form.html",
                  **_context(row=r, form=form, errors={}, editing={name: {"form": form, "errors": {}}}))


@bp.post("/tiers/<name>")
@operator_required
def save(name: str) -> Response | tuple[str, int]:
    r = _row(name)
    fields = editable_tier_fields()
    form = {f: (request.form.get(f) or "").strip() for f in fields}
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for f, kind in fields.items():
        values[f], problem = validation.parse_number(form[f], kind)
        if problem:
            errors[f] = [problem]
    reason, problem = reason_field()
    form["reason"] = reason
    if problem:
        errors["reason"] = [problem]
    if not errors:
        result = edits.set_fields(sluice().state, actor=actor(), scope="tier", target=name, values=values,
                                  reason=reason)
        if result.ok:
            if not is_htmx():
                return redirect(url_for("tiers.page"), code=303)
            return region("tiers.html", "_tier_row.html", **_context(row=_row(name), saved=bool(result.changed)))
        errors = validation.field_errors(result.problems, ("tiers", name), tuple(fields), FALLBACK)
    return region("tiers.html", "_tier_form.html", 422,
                  **_context(row=r, form=form, errors=errors, editing={name: {"form": form, "errors": errors}}))
