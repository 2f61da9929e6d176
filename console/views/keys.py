"""Tenants and keys: create a tenant, issue, revoke and rotate its keys (operators).

The key is in the answer to the POST that made it and nowhere else: shown once.
Every answer to a change also fires ``tenants-changed`` so the table refreshes.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, request
from werkzeug.wrappers import Response

from console import keys, validation
from console.security import operator_required
from console.validation import PathProblem
from console.views import tenants
from console.views.common import actor, reason_field, region, sluice, snapshot

bp = Blueprint("keys", __name__)
CHANGED = {"HX-Trigger": "tenants-changed"}


def _panel(name: str, status: int = 200, **extra: Any) -> tuple[str, int]:
    snap = snapshot()
    if snap is None or name not in snap.policy.tenants:
        abort(404, description=f"no tenant {name!r}")
    ctx = tenants._context(**{"keys_tenant": name, "key_views": keys.key_views(snap, name), "key_errors": {},
                              **extra})
    return region("tenants.html", "_tenant_keys.html", status, **ctx)


def _answer(body: tuple[str, int], ok: bool) -> Response:
    return Response(body[0], body[1], headers=CHANGED if ok else {})


def _messages(found: list[PathProblem]) -> list[str]:
    return [p.message for p in found]


@bp.get("/tenants/<name>/keys")
def panel(name: str) -> tuple[str, int]:
    return _panel(name)


@bp.post("/tenants")
@operator_required
def create() -> Response:
    form = {f: " ".join((request.form.get(f) or "").split()) for f in ("name", "tier")}
    reason, problem = reason_field()
    form["reason"] = reason
    errors: dict[str, list[str]] = {}
    if problem:
        errors["reason"] = [problem]
    if not form["name"]:
        errors["name"] = ["name the tenant"]
    if not form["tier"]:
        errors["tier"] = ["choose a tier"]
    if not errors:
        result = keys.create_tenant(sluice().state, actor=actor(), name=form["name"], tier=form["tier"],
                                    reason=reason)
        if result.ok:
            return _answer(_panel(form["name"], 201, new_key=result.key, created=True), True)
        errors = validation.field_errors(result.problems, (), ("name", "tier", "keys"))
    ctx = tenants._context(new_form=form, new_errors=errors)
    body, status = region("tenants.html", "_tenant_new.html", 422, **ctx)
    # The form asked for the keys panel; its errors belong in the form itself.
    return Response(body, status, headers={"HX-Retarget": "#tenant-new", "HX-Reswap": "outerHTML"})


def _change(name: str, fn: Any, **kw: Any) -> Response:
    reason, problem = reason_field()
    if problem:
        return _answer(_panel(name, 422, key_errors={"": [problem]}), False)
    result = fn(sluice().state, actor=actor(), tenant=name, reason=reason, **kw)
    if not result.ok:
        return _answer(_panel(name, 422, key_errors={"": _messages(result.problems)}), False)
    return _answer(_panel(name, 201 if result.key else 200, new_key=result.key,
                          revoked=kw.get("key_hash") if not result.key else None), True)


@bp.post("/tenants/<name>/keys")
@operator_required
def issue(name: str) -> Response:
    return _change(name, keys.issue_key)


@bp.post("/tenants/<name>/keys/<key_hex>/<any(revoke, rotate):action>")
@operator_required
def change(name: str, key_hex: str, action: str) -> Response:
    digest = "sha256:" + key_hex
    if not keys.HASH.match(digest):
        abort(404, description="no such key")
    return _change(name, keys.revoke_key if action == "revoke" else keys.rotate_key, key_hash=digest)
