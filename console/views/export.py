"""Export: the effective policy as YAML, the diff against the files, overrides and conflicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, Response, abort, redirect, request, url_for
from werkzeug.wrappers import Response as BaseResponse

from console import edits, exporter
from console.security import is_htmx, operator_required
from console.views.common import actor, reason_field, region, sluice, snapshot

bp = Blueprint("export", __name__)


def _directory() -> str:
    """The files' path as git sees it from where the console runs (the repository root)."""
    d = sluice().config.policy_dir
    try:
        return d.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return d.name or "policies"


def _context(**extra: Any) -> dict[str, Any]:
    snap = snapshot()
    if snap is None:
        return {"snap": None, "files": [], "yaml": "", "conflicts": [], "overrides": [], "errors": {}, **extra}
    files = exporter.files(snap, _directory())
    return {"snap": snap, "files": files, "yaml": exporter.effective_yaml(snap), "conflicts": snap.conflicts,
            "overrides": snap.overrides, "errors": {}, **extra}


@bp.get("/export")
def page() -> tuple[str, int]:
    return region("export.html", "export.html", **_context())


@bp.get("/export/overrides")
def overrides_region() -> tuple[str, int]:
    return region("export.html", "_overrides.html", **_context())


@bp.get("/export/policy.yaml")
def policy_yaml() -> Response:
    snap = snapshot()
    if snap is None:
        abort(503, description="no valid policy imported")
    return Response(exporter.effective_yaml(snap), mimetype="application/yaml",
                    headers={"Content-Disposition": 'attachment; filename="sluice-policy.yaml"'})


@bp.get("/export/policy.diff")
def policy_diff() -> Response:
    snap = snapshot()
    if snap is None:
        abort(503, description="no valid policy imported")
    return Response(exporter.combined_diff(exporter.files(snap, _directory())), mimetype="text/x-diff",
                    headers={"Content-Disposition": 'attachment; filename="sluice-policy.diff"'})


@bp.post("/overrides/<int:override_id>/<any(revert, keep):action>")
@operator_required
def resolve(override_id: int, action: str) -> BaseResponse | tuple[str, int]:
    reason, problem = reason_field()
    if problem:
        return region("export.html", "_overrides.html", 422,
                      **_context(errors={override_id: problem}, reasons={override_id: request.form.get("reason")}))
    fn = edits.revert if action == "revert" else edits.keep
    if not fn(sluice().state, actor=actor(), override_id=override_id, reason=reason):
        abort(404, description="no such active override")
    if not is_htmx():
        return redirect(url_for("export.page"), code=303)
    return region("export.html", "_overrides.html", **_context())
