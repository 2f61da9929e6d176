"""One pool endpoint's breaker from its Overview row: trip, reset or clear by hand.

The form opens below the backends table (outside the region that polls itself, so a
poll does not wipe what is being typed); a change is stored like every manual trip
(an override in SQLite, served in the policy's ``breakers`` with ``endpoint``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, abort, redirect, url_for
from werkzeug.wrappers import Response

from console import edits
from console.security import is_htmx, operator_required
from console.views.breakers import manual_by_endpoint, parse_form
from console.views.common import actor, region, sluice, snapshot
from console.views.overview import _context as overview_context

bp = Blueprint("endpoint_breakers", __name__)
DONE = {"trip": "tripped", "reset": "reset", "clear": "cleared"}


def _known(backend: str, endpoint: str) -> None:
    snap = snapshot()
    spec = next((b for b in snap.policy.backends if b.name == backend), None) if snap else None
    if spec is None:
        abort(404, description=f"no backend {backend!r}")
    if endpoint not in [e.key for e in spec.endpoints]:
        abort(404, description=f"backend {backend!r} has no endpoint {endpoint!r}")


def _render(backend: str, endpoint: str, status: int = 200, **form: Any) -> tuple[str, int]:
    snap = snapshot()
    current = manual_by_endpoint(snap.doc).get((backend, endpoint)) if snap else None
    ctx = {"backend": backend, "endpoint": endpoint, "current": current, "form": {}, "errors": {}, **form}
    return region("overview.html", "_endpoint_breaker_form.html", status,
                  **overview_context(), endpoint_form=ctx, **ctx)


# The endpoint's host:port is the URL's <address> (``endpoint`` is url_for's own parameter).
@bp.get("/overview/endpoints/<backend>/<address>/breaker")
@operator_required
def form(backend: str, address: str) -> tuple[str, int]:
    _known(backend, address)
    return _render(backend, address)


@bp.post("/overview/endpoints/<backend>/<address>/breaker")
@operator_required
def change(backend: str, address: str) -> Response | tuple[str, int]:
    endpoint = address
    _known(backend, endpoint)
    action, reason, minutes, form, errors = parse_form()
    if not errors:
        result = edits.set_breaker(sluice().state, actor=actor(), backend=backend, endpoint=endpoint,
                                   action=action, reason=reason, minutes=minutes)
        if result.ok:
            if not is_htmx():
                return redirect(url_for("overview.page"), code=303)
            body, status = _render(backend, endpoint, done=DONE[action])
            return Response(body, status, headers={"HX-Trigger": "breaker-changed"})
        errors = {"": [p.message for p in result.problems]}
    return _render(backend, endpoint, 422, form=form, errors=errors)
