"""The replica API (bearer token): the effective policy with ETag/long-poll, status reports.

``GET /api/v1/policy[?wait=N]``
    200 with the policy JSON and a strong ``ETag``; 304 when ``If-None-Match`` names
    the current ETag. With ``wait`` (seconds, at most 30) and a matching
    ``If-None-Match`` the answer is held until the policy changes or the time is up,
    so a change reaches every replica within about a second without polling fast.
``POST /api/v1/replicas/<id>/status``
    the replica's live state (see ``console.live``); answers ``{"policy_etag": ...,
    "budget_spend": [...]}`` so a replica can tell it is behind, and has the durable copy
    of the current budget periods' spend (``console.usage``).
``GET /api/v1/budgets``
    that copy alone: a replica reads it once before serving.
"""

from __future__ import annotations

import math
import re
from typing import Any

from flask import Blueprint, Response, jsonify, request

from console import live, reports, usage
from console.policystate import NoPolicy, Snapshot
from console.views.common import sluice

bp = Blueprint("api", __name__, url_prefix="/api/v1")
REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
PRUNE_EVERY_S = 60.0


def _etags(header: str | None) -> set[str]:
    if not header:
        return set()
    tags = set()
    for part in header.split(","):
        tag = part.strip()
        tags.add(tag[2:] if tag.startswith("W/") else tag)  # weak comparison is fine for GET
    return tags


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> tuple[Response, int]:
    return jsonify({"error": {"message": message, "type": "invalid_request" if status < 500 else "unavailable",
                              "code": code, "param": param}}), status


def _policy_response(snap: Snapshot, etags: set[str]) -> Response:
    headers = {"ETag": snap.etag, "Cache-Control": "no-cache"}
    if snap.etag in etags or "*" in etags:
        return Response(status=304, headers=headers)
    return Response(snap.body, status=200, mimetype="application/json", headers=headers)


@bp.get("/policy")
def policy() -> Response | tuple[Response, int]:
    s = sluice()
    etags = _etags(request.headers.get("If-None-Match"))
    raw = request.args.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait):
        return _error(400, f"wait must be a number of seconds, got {raw!r}")
    wait = min(max(wait, 0.0), s.config.max_wait_s)
    try:
        snap = s.state.wait_change(etags, wait) if wait and etags else s.state.snapshot()
    except NoPolicy as exc:
        return _error(503, f"no valid policy: {exc}")
    return _policy_response(snap, etags)


@bp.post("/replicas/<replica>/status")
def status(replica: str) -> Response | tuple[Response, int]:
    if not REPLICA_ID.match(replica):
        return _error(400, "replica id: letters, digits, _ . : - (at most 64)", "invalid_replica_id")
    if (request.content_length or 0) > reports.MAX_BYTES:
        return _error(400, f"a status report is at most {reports.MAX_BYTES} bytes, got {request.content_length}",
                      "report_too_large")
    body: Any
    body, violation = reports.parse(request.stream.read(reports.MAX_BYTES + 1))
    if violation is not None:
        return _error(400, violation.message, violation.code, violation.param)
    s = sluice()
    now = s.now()
    try:
        snap = s.state.snapshot()
        known: set[str] | None = {b.name for b in snap.policy.backends}
        tenants: set[str] | None = set(snap.policy.tenants)
        etag: str | None = snap.etag
    except NoPolicy:
        known = tenants = etag = None
    live.ingest(s.store, replica, body, now, known, tenants)
    if now - s.last_prune > PRUNE_EVERY_S:
        s.last_prune = now
        live.prune(s.store, now, forget_after=s.config.replica_forget_after_s,
                   usage_retention_days=s.config.usage_retention_days)
    return jsonify({"ok": True, "policy_etag": etag, "budget_spend": usage.current_spend(s.store, now)})


@bp.get("/budgets")
def budgets() -> Response:
    s = sluice()
    return jsonify({"budget_spend": usage.current_spend(s.store, s.now())})


@bp.get("/replicas")
def replicas() -> Response:
    s = sluice()
    reps = live.replicas(s.store, s.now(), s.config.stale_after_s, hide_after=s.config.replica_hide_after_s)
    return jsonify([{"id": r.id, "last_seen": r.last_seen, "stale": r.stale, "policy_etag": r.etag}
                    for r in reps])
