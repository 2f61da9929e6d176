"""Sessions, CSRF, roles and response headers, applied to every request in one place.

- Pages and their HTMX partials need a session; the replica API needs the bearer token
  and ignores sessions (a logged-in browser cannot be used to post fake replica state).
- Every state change from a browser carries the session's CSRF token, in the form
  (``csrf_token``) or, for HTMX, in the ``X-CSRF-Token`` header set on ``<body>``.
- Unauthenticated: the API and HTMX get 401 (HTMX with ``HX-Redirect`` to the login
  page), a page gets redirected to the login page. Never data.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar
from urllib.parse import urlsplit

from flask import (
    Flask,
    Response,
    abort,
    current_app,
    g,
    jsonify,
    redirect,
    request,
    session,
    url_for,
)

from console import sessions, users

F = TypeVar("F", bound=Callable[..., Any])
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
PUBLIC_ENDPOINTS = ("auth.login", "static", "health")

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=()",
}


def csrf_token() -> str:
    token = session.get("csrf")
    if not token:
        token = secrets.token_urlsafe(32)
        session["csrf"] = token
    return str(token)


def is_htmx() -> bool:
    return request.headers.get("HX-Request") == "true"


def is_api() -> bool:
    return request.blueprint == "api"


def safe_next(target: str | None) -> str:
    """Only same-site paths: a login link must not bounce users to another host."""
    if not target or not target.startswith("/") or target.startswith("//") or urlsplit(target).netloc:
        return url_for("overview.page")
    return target


def _load_user() -> Response | None:
    g.user = None
    sid = session.get("sid")
    if isinstance(sid, str):
        s = current_app.extensions["sluice"]
        # The session must still exist server-side: logout and password/role changes end it.
        uid = sessions.user_of(s.store, sid, s.now(), current_app.permanent_session_lifetime.total_seconds())
        if uid is not None:
            g.user = users.get(s.store, uid)
    if g.user is None and request.endpoint not in PUBLIC_ENDPOINTS:
        if is_htmx():
            resp = Response("login required", status=401, mimetype="text/plain")
            resp.headers["HX-Redirect"] = url_for("auth.login")
            return resp
        if request.method in SAFE_METHODS:
            return redirect(url_for("auth.login", next=request.full_path.rstrip("?")))
        return Response("login required", status=401, mimetype="text/plain")
    return None


def _check_csrf() -> None:
    if request.method in SAFE_METHODS:
        return
    sent = request.headers.get("X-CSRF-Token") or request.form.get("csrf_token") or ""
    expected = session.get("csrf") or ""
    if not expected or not hmac.compare_digest(str(sent), str(expected)):
        abort(403, description="missing or wrong CSRF token; reload the page and try again")


def _check_bearer() -> Response | None:
    token = current_app.extensions["sluice"].api_token
    header = request.headers.get("Authorization", "")
    scheme, _, sent = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), token.encode()):
        resp = jsonify({"error": {"message": "missing or wrong API token", "type": "unauthorized"}})
        resp.status_code = 401
        resp.headers["WWW-Authenticate"] = 'Bearer realm="sluice-console"'
        return resp
    return None


def before_request() -> Response | None:
    if request.endpoint is None:
        return None  # 404 follows; nothing to protect
    if is_api():
        return _check_bearer()
    denied = _load_user()
    if denied is not None:
        return denied
    _check_csrf()
    return None


def after_request(resp: Response) -> Response:
    for key, value in HEADERS.items():
        resp.headers.setdefault(key, value)
    if request.endpoint != "static":
        resp.headers.setdefault("Cache-Control", "no-store")
    # Partials and full pages share URLs: caches must keep them apart.
    resp.vary.add("HX-Request")
    return resp


def operator_required(fn: F) -> F:
    """Viewers see everything and change nothing."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if g.user is None or not g.user.can_edit:
            abort(403, description="operators only: your account can view but not change")
        return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def install(app: Flask) -> None:
    app.before_request(before_request)
    app.after_request(after_request)
    app.jinja_env.globals["csrf_token"] = csrf_token
