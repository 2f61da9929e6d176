"""Tiers: every field the schema gives a tier, the numeric ones editable inline."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flask import Blueprint
from werkzeug.wrappers import Response

from console import validation
from console.overrides import editable_tier_fields, get_field, tier_fields
from console.security import operator_required
from console.views._forms import RowEditor, posted
from console.views.common import region, snapshot

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


EDITOR = RowEditor(scope="tier", index="tiers.page", page="tiers.html", row_template="_tier_row.html",
                   form_template="_tier_form.html", rows=_rows, context=_context)


@bp.get("/tiers")
def page() -> tuple[str, int]:
    return region("tiers.html", "tiers.html", **_context())


@bp.get("/tiers/<name>")
def row(name: str) -> tuple[str, int]:
    return EDITOR.row(name)


@bp.get("/tiers/<name>/edit")
@operator_required
def edit(name: str) -> tuple[str, int]:
    r = EDITOR.find_row(name)
    snap = snapshot()
    in_doc = snap.doc["tiers"].get(name, {}) if snap else {}
    return EDITOR.form(name, r, {f: _show(get_field(in_doc, f)) for f in editable_tier_fields()})


@bp.post("/tiers/<name>")
@operator_required
def save(name: str) -> Response | tuple[str, int]:
    r = EDITOR.find_row(name)
    fields = editable_tier_fields()
    form = posted(fields)
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for f, kind in fields.items():
        values[f], problem = validation.parse_number(form[f], kind)
        if problem:
            errors[f] = [problem]
    return EDITOR.save(name, r, form, values, errors,
                       lambda found: validation.field_errors(found, ("tiers", name), tuple(fields), FALLBACK))
