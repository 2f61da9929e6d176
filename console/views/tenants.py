"""Tenants: tier and limits (editable inline), live usage from the replicas."""

from __future__ import annotations

from typing import Any

from flask import Blueprint
from werkzeug.wrappers import Response

from console import live, usage, validation
from console.overrides import TENANT_FIELDS
from console.security import operator_required
from console.views._forms import RowEditor, posted
from console.views.common import region, sluice, snapshot

bp = Blueprint("tenants", __name__)
LIVE_WINDOW_S = 5 * 60
NUMBERS = ("tpm", "rpm", "max_concurrency")


def _rows() -> list[dict[str, Any]]:
    snap = snapshot()
    if snap is None:
        return []
    overridden = {(o.target, o.field) for o in snap.overrides if o.scope == "tenant"}
    created = {o.target for o in snap.overrides if o.scope == "tenant_new"}
    rows = []
    for t in snap.policy.tenants.values():
        rows.append({"name": t.name, "tenant": t, "limits": snap.policy.limits(t), "keys": len(t.key_hashes),
                     "overridden": {f for f in TENANT_FIELDS if (t.name, f) in overridden},
                     "created": t.name in created})
    return rows


def _context(**extra: Any) -> dict[str, Any]:
    s = sluice()
    now = s.now()
    snap = snapshot()
    reps = live.replicas(s.store, now, s.config.stale_after_s, s.config.replica_hide_after_s)
    return {"rows": _rows(), "tiers": sorted(snap.policy.tiers) if snap else [],
            "live": live.tenant_live(s.store, reps, now - LIVE_WINDOW_S), "window_min": LIVE_WINDOW_S // 60,
            "budgets": _budget_shares(snap, s.store, now),
            "editing": {}, "new_form": {}, "new_errors": {}, "keys_tenant": None, **extra}


def _budget_shares(snap: Any, store: Any, now: float) -> dict[str, dict[str, Any]]:
    """Per budgeted tenant: its budget's period, the share used and the alerts reached."""
    if snap is None:
        return {}
    from extproc.policy.budget import Amount

    found = usage.standings(store, now)
    out = {}
    for t in snap.policy.tenants.values():
        b = snap.policy.budget(t)
        if b is None:
            continue
        st = found.get(t.name)
        share = b.used_fraction(Amount(st.used_tokens, st.used_nanos)) if st is not None else 0.0
        out[t.name] = {"period": b.period, "share": share, "alerts": [a for a in b.alerts if share >= a]}
    return out


EDITOR = RowEditor(scope="tenant", index="tenants.page", page="tenants.html", row_template="_tenant_row.html",
                   form_template="_tenant_form.html", rows=_rows, context=_context)


@bp.get("/tenants")
def page() -> tuple[str, int]:
    return region("tenants.html", "tenants.html", **_context())


@bp.get("/tenants/table")
def table() -> tuple[str, int]:
    return region("tenants.html", "_tenant_table.html", **_context())


@bp.get("/tenants/live")
def live_region() -> tuple[str, int]:
    return region("tenants.html", "_tenants_live.html", **_context())


@bp.get("/tenants/<name>")
def row(name: str) -> tuple[str, int]:
    return EDITOR.row(name)


@bp.get("/tenants/<name>/edit")
@operator_required
def edit(name: str) -> tuple[str, int]:
    r = EDITOR.find_row(name)
    return EDITOR.form(name, r, {f: _show(getattr(r["tenant"], f)) for f in TENANT_FIELDS})


@bp.post("/tenants/<name>")
@operator_required
def save(name: str) -> Response | tuple[str, int]:
    r = EDITOR.find_row(name)
    form = posted(TENANT_FIELDS)
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {"tier": form["tier"] or None}
    if not form["tier"]:
        errors["tier"] = ["choose a tier"]
    for f in NUMBERS:
        values[f], problem = validation.parse_int(form[f])
        if problem:
            errors[f] = [problem]
    return EDITOR.save(name, r, form, values, errors,
                       lambda found: validation.field_errors(found, ("tenants", _index(name)), TENANT_FIELDS))


def _index(name: str) -> int:
    snap = snapshot()
    names = [t.get("name") for t in snap.doc.get("tenants", [])] if snap else []
    return names.index(name) if name in names else -1


def _show(value: Any) -> str:
    return "" if value is None else str(value)
