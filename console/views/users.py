"""Users: who can log in and with which role; operators create users and change roles.

The same functions as ``python -m console create-user`` (``console.users``): audited in the
same transaction, and a new role ends every session of that user. The page refuses to take
the role from the last operator; the CLI stays the way back in.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, redirect, request, url_for
from werkzeug.wrappers import Response

from console import users
from console.security import is_htmx, operator_required
from console.views.common import actor, region, sluice

bp = Blueprint("users", __name__)


def _context(**extra: Any) -> dict[str, Any]:
    return {
        "accounts": users.accounts(sluice().store),
        "roles": users.ROLES,
        "new_form": {},
        "new_errors": {},
        "role_errors": {},
        "done": None,
        **extra,
    }


def _answer(status: int = 200, **extra: Any) -> Response | tuple[str, int]:
    if status < 300 and not is_htmx():
        return redirect(url_for("users.page"), code=303)
    return region("users.html", "_users.html", status, **_context(**extra))


@bp.get("/users")
def page() -> tuple[str, int]:
    return region("users.html", "users.html", **_context())


@bp.post("/users")
@operator_required
def create() -> Response | tuple[str, int]:
    form = {
        "name": " ".join((request.form.get("name") or "").split()),
        "role": request.form.get("role") or "",
    }
    password, again = request.form.get("password") or "", request.form.get("again") or ""
    errors: dict[str, list[str]] = {}
    if password != again:
        errors["again"] = ["the passwords differ"]
    if not errors:
        s = sluice()
        if not s.hashing.try_enter():  # scrypt: as bounded as a login's check
            errors[""] = ["the console is busy checking passwords: try again"]
        else:
            try:
                users.create(
                    s.store, form["name"], password, form["role"], actor=actor(), now=s.now()
                )
            except ValueError as exc:
                field = (
                    "password"
                    if "password" in str(exc)
                    else "role"
                    if "role" in str(exc)
                    else "name"
                )
                errors[field] = [str(exc)]
            finally:
                s.hashing.leave()
    if errors:
        return _answer(422, new_form=form, new_errors=errors)
    return _answer(done=f"created {form['role']} {form['name']!r}")


@bp.post("/users/<name>/role")
@operator_required
def role(name: str) -> Response | tuple[str, int]:
    s = sluice()
    new = request.form.get("role") or ""
    try:
        users.set_role(s.store, name, new, actor=actor(), now=s.now(), keep_an_operator=True)
    except ValueError as exc:
        status = 404 if str(exc).startswith("no user") else 422
        return _answer(status, role_errors={name: [str(exc)]})
    return _answer(done=f"{name!r} is now {new}; their sessions ended")
