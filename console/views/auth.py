"""Login and logout."""

from __future__ import annotations

from flask import Blueprint, redirect, render_template, request, session, url_for
from werkzeug.wrappers import Response

from console import security, users
from console.views.common import install_context, sluice

bp = Blueprint("auth", __name__)
install_context(bp)


@bp.route("/login", methods=["GET", "POST"])
def login() -> Response | tuple[str, int]:
    next_url = security.safe_next(request.values.get("next"))
    if request.method == "GET":
        return render_template("login.html", next=next_url, error=None, name=""), 200
    name = (request.form.get("name") or "").strip()
    user = users.authenticate(sluice().store, name, request.form.get("password") or "")
    if user is None:
        return render_template("login.html", next=next_url, error="wrong name or password", name=name), 401
    # A fresh session (and CSRF token) at login: nothing set before it carries over.
    session.clear()
    session.permanent = True
    session["uid"] = user.id
    security.csrf_token()
    return redirect(next_url, code=303)


@bp.post("/logout")
def logout() -> Response:
    session.clear()
    return redirect(url_for("auth.login"), code=303)
