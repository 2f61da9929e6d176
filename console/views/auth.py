"""Login, logout and the password change, with throttling and an audit of failures."""

from __future__ import annotations

from flask import Blueprint, current_app, g, redirect, render_template, request, session, url_for
from werkzeug.wrappers import Response

from console import audit, proxies, security, sessions, throttle, users
from console.views.common import install_context, sluice

bp = Blueprint("auth", __name__)
install_context(bp)


def _addr() -> str:
    # The peer address, or behind a configured reverse proxy the client's from its
    # X-Forwarded-For (console.proxies). Behind a proxy that is not configured every login
    # shares the proxy's address: the per-address limit then covers them all.
    peer = request.remote_addr or ""
    return proxies.client_address(peer, request.headers.getlist("X-Forwarded-For"),
                                  sluice().config.trusted_proxies)[:64]


def _throttled(next_url: str, name: str, seconds: float, why: str) -> tuple[str, int, dict[str, str]]:
    wait = throttle.header_value(seconds)
    body = render_template("login.html", next=next_url, name=name, retry_after=int(wait),
                           error=f"{why}: try again in {wait} s")
    return body, 429, {"Retry-After": wait}


@bp.route("/login", methods=["GET", "POST"])
def login() -> Response | tuple[str, int] | tuple[str, int, dict[str, str]]:
    next_url = security.safe_next(request.values.get("next"))
    if request.method == "GET":
        return render_template("login.html", next=next_url, error=None, name=""), 200
    s = sluice()
    name = " ".join((request.form.get("name") or "").split())[:64]
    addr = _addr()
    now = s.now()
    # Refused before any hashing: a throttled guess costs the console nothing.
    wait = throttle.retry_after(s.store, s.throttle, name, addr, now)
    if wait > 0:
        _audit_throttled(name, addr, now, wait)
        return _throttled(next_url, name, wait, "too many failed logins")
    if not s.hashing.try_enter():
        return _throttled(next_url, name, 1, "the console is busy checking other logins")
    try:
        user = users.authenticate(s.store, name, request.form.get("password") or "")
    finally:
        s.hashing.leave()
    if user is None:
        throttle.record_failure(s.store, s.throttle, name, addr, now)
        wait = throttle.retry_after(s.store, s.throttle, name, addr, now)
        with s.store.write() as db:
            audit.record(db, at=now, actor=name or "(blank)", kind="auth.login_failed", target=addr or "(unknown)",
                         summary=f"failed login as {name!r} from {addr or 'an unknown address'}",
                         detail={"name": name, "addr": addr, "throttled_for_s": round(wait, 1)})
        return render_template("login.html", next=next_url, error="wrong name or password", name=name), 401
    throttle.clear(s.store, name)
    # A fresh session (and CSRF token) at login: nothing set before it carries over.
    session.clear()
    session.permanent = True
    session["sid"] = sessions.create(s.store, user.id, addr, now)
    security.csrf_token()
    sessions.prune(s.store, now, current_app.permanent_session_lifetime.total_seconds())
    return redirect(next_url, code=303)


def _audit_throttled(name: str, addr: str, now: float, wait: float) -> None:
    """Refused attempts are audited once a minute per name and address, not each one:
    a flood must not be a way to fill the audit log."""
    s = sluice()
    recent = s.store.one("SELECT 1 AS x FROM audit WHERE at > ? AND kind = 'auth.login_throttled' AND actor = ? "
                         "AND target = ?", [now - 60, name or "(blank)", addr or "(unknown)"])
    if recent:
        return
    with s.store.write() as db:
        audit.record(db, at=now, actor=name or "(blank)", kind="auth.login_throttled", target=addr or "(unknown)",
                     summary=f"login as {name!r} from {addr or 'an unknown address'} refused: throttled "
                             f"for {wait:.0f} s more", detail={"name": name, "addr": addr, "retry_after_s": wait})


@bp.post("/logout")
def logout() -> Response:
    sid = session.get("sid")
    if isinstance(sid, str):
        sessions.end(sluice().store, sid)
    session.clear()
    return redirect(url_for("auth.login"), code=303)


@bp.route("/account/password", methods=["GET", "POST"])
def password() -> Response | tuple[str, int]:
    """Change one's own password; every other session of the account ends."""
    if request.method == "GET":
        return render_template("password.html", error=None, done=False), 200
    s = sluice()
    current = request.form.get("current") or ""
    new = request.form.get("new") or ""
    if new != (request.form.get("again") or ""):
        return render_template("password.html", error="the new passwords differ", done=False), 422
    if not s.hashing.try_enter():
        return render_template("password.html", error="the console is busy: try again", done=False), 429
    try:
        ok = users.verify(s.store, g.user.id, current)
    finally:
        s.hashing.leave()
    if not ok:
        return render_template("password.html", error="the current password is wrong", done=False), 403
    try:
        users.change_password(s.store, g.user.id, new, keep_session=session.get("sid"))
    except ValueError as exc:
        return render_template("password.html", error=str(exc), done=False), 422
    with s.store.write() as db:
        audit.record(db, at=s.now(), actor=g.user.name, kind="auth.password_changed", target=g.user.name,
                     summary="password changed; the account's other sessions ended")
    return render_template("password.html", error=None, done=True), 200
