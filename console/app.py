"""The Flask app factory: one store, one policy state, blueprints, security hooks."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from console import security
from console.config import ConsoleConfig
from console.context import Sluice
from console.policystate import PolicyState
from console.store import Store
from console.throttle import Hashing, Throttle

SESSION_LIFETIME = timedelta(hours=12)


def create_app(config: ConsoleConfig) -> Flask:
    from console.views import BLUEPRINTS

    clock = config.clock or time.time
    store = Store(config.db_path)
    try:
        secret = config.secret_key or store.setting_or_create("secret_key", lambda: secrets.token_hex(32))
        token = config.api_token or store.setting_or_create("api_token", lambda: secrets.token_urlsafe(32))
        state = PolicyState(store, config.policy_dir, config.reload_interval, clock)
    except Exception:
        store.close()
        raise

    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=secret,
        SESSION_COOKIE_NAME="sluice_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=config.secure_cookies,
        PERMANENT_SESSION_LIFETIME=SESSION_LIFETIME,
        MAX_CONTENT_LENGTH=1 << 20,
        TEMPLATES_AUTO_RELOAD=False,
    )
    app.jinja_env.autoescape = True  # every template, whatever its extension
    throttle = Throttle(free=config.login_free_failures, addr_free=config.login_addr_free_failures,
                        window_s=config.login_window_s, max_delay_s=config.login_max_delay_s)
    app.extensions["sluice"] = Sluice(config, store, state, token, clock, throttle,
                                      Hashing(config.login_concurrency))
    security.install(app)
    _filters(app)
    for bp in BLUEPRINTS:
        app.register_blueprint(bp)

    @app.get("/healthz")
    def health() -> Response | tuple[Response, int]:
        # A console whose database fails serves 500s and may lose writes: not healthy.
        problem = store.check()
        if problem is not None:
            return jsonify({"status": "failing", "problem": problem}), 503
        return jsonify({"status": "ok"})

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        if security.is_api() or request.path.startswith("/api/"):
            return jsonify({"error": {"message": exc.description, "type": exc.name.lower().replace(" ", "_")}}), \
                exc.code
        if security.is_htmx():
            # Shown in the page's flash area, not in place of the region that asked.
            headers = {"HX-Retarget": "#flash", "HX-Reswap": "innerHTML"}
            return render_template("_error.html", error=exc), exc.code, headers
        return render_template("error.html", error=exc), exc.code

    return app


def _filters(app: Flask) -> None:
    def dash(value: Any, fmt: str = "{}") -> str:
        return "—" if value is None or value == "" else fmt.format(value)

    def pct(value: float | None) -> str:
        return "—" if value is None else f"{value * 100:.0f} %"

    def ago(seconds: float | None) -> str:
        if seconds is None:
            return "—"
        if seconds < 90:
            return f"{seconds:.0f} s ago"
        if seconds < 5400:
            return f"{seconds / 60:.0f} min ago"
        return f"{seconds / 3600:.1f} h ago"

    def when(epoch: float | None) -> str:
        if epoch is None:
            return "—"
        return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    def number(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float) and not value.is_integer():
            return f"{value:,.2f}"
        return f"{int(value):,}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)

    app.jinja_env.filters.update(dash=dash, pct=pct, ago=ago, when=when, number=number)
