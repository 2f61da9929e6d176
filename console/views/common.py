"""Helpers shared by the page views."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, g, render_template, request

from console.context import Sluice
from console.policystate import NoPolicy, Snapshot
from console.security import is_htmx


def sluice() -> Sluice:
    ext: Sluice = current_app.extensions["sluice"]
    return ext


def snapshot() -> Snapshot | None:
    try:
        return sluice().state.snapshot()
    except NoPolicy:
        return None


def region(page: str, partial: str, status: int = 200, **ctx: Any) -> tuple[str, int]:
    """The partial alone for HTMX, the whole page (which includes it) otherwise."""
    return render_template(partial if is_htmx() else page, **ctx), status


def reason_field() -> tuple[str, str | None]:
    reason = " ".join((request.form.get("reason") or "").split())
    if not reason:
        return "", "say why: the reason goes into the audit log"
    if len(reason) > 500:
        return reason[:500], "keep the reason under 500 characters"
    return reason, None


def actor() -> str:
    return str(g.user.name)


def install_context(bp: Blueprint) -> None:
    @bp.app_context_processor
    def _context() -> dict[str, Any]:
        s = sluice()
        snap = snapshot() if getattr(g, "user", None) is not None else None
        return {
            "user": getattr(g, "user", None),
            "base_problems": s.state.base_problems,
            "conflict_count": len(snap.conflicts) if snap else 0,
            "no_policy": snap is None,
        }
