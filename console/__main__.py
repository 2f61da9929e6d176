"""Command line: ``python -m console {serve,create-user}``.

    python -m console serve --db var/console.db --policy policies/ --host 127.0.0.1 --port 8080 [--demo]
    python -m console create-user NAME --role operator|viewer [--password P] --db var/console.db

Secrets can come from the environment or a file instead of the command line (where
``ps`` shows them): ``SLUICE_CONSOLE_TOKEN`` or ``--api-token-file`` /
``SLUICE_CONSOLE_TOKEN_FILE`` (the replicas' bearer token),
``SLUICE_CONSOLE_SECRET`` (the session key), ``SLUICE_CONSOLE_PASSWORD``
(for create-user), ``SLUICE_CONSOLE_DEMO_PASSWORD`` (for ``serve --demo``).
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import NoReturn

DEFAULT_DB = "var/console.db"


def _serve(args: argparse.Namespace) -> int:
    import waitress

    from console import users
    from console.app import create_app
    from console.config import ConsoleConfig, read_secret_file
    from console.proxies import parse_networks

    token = args.api_token or (read_secret_file(args.api_token_file) if args.api_token_file else None)
    try:
        proxies = parse_networks(args.trusted_proxy) or None
        cfg = ConsoleConfig.from_env(
            args.db, args.policy, api_token=token, reload_interval=args.reload_interval,
            secure_cookies=args.secure_cookies, replica_hide_after_s=args.replica_hide_after,
            replica_forget_after_s=args.replica_forget_after,
            login_concurrency=args.login_concurrency, trusted_proxies=proxies)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_app(cfg)
    sluice = app.extensions["sluice"]
    try:
        lines = []
        if args.demo:
            given = args.demo_password or os.environ.get("SLUICE_CONSOLE_DEMO_PASSWORD")
            password = given or secrets.token_urlsafe(9)
            users.create(sluice.store, args.demo_user, password, "operator", replace=True)
            if not given:  # whoever chose the password knows it; a made-up one must be shown
                lines.append(f"  demo operator: {args.demo_user} / {password}")
        if args.show_token:  # a terminal's scrollback is no place for a bearer token unless asked
            lines.append(f"  replica API token: {sluice.api_token}")
        # Long-polls from replicas each hold a thread for up to 30 s: keep plenty.
        server = waitress.create_server(app, host=args.host, port=args.port, threads=args.threads,
                                        ident="sluice-console")
        port = getattr(server, "effective_port", args.port)
        print(f"sluice console: http://{args.host}:{port}/ (db {cfg.db_path}, policy {cfg.policy_dir})", flush=True)
        for line in lines:
            print(line, flush=True)

        def stop(*_: object) -> NoReturn:
            # Before waitress's own shutdown, which waits up to 5 s for busy threads: the
            # replicas' long-polls answer now instead of holding theirs for up to 30 s.
            sluice.store.stop_waiting()
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        finally:
            server.close()
    finally:
        sluice.close()
    return 0


def _cli_actor() -> str:
    """Who ran the CLI, for the audit log."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return f"cli:uid {os.getuid()}"


def _create_user(args: argparse.Namespace) -> int:
    from console import users
    from console.store import Store

    password = args.password or os.environ.get("SLUICE_CONSOLE_PASSWORD")
    if not password:
        password = getpass.getpass(f"password for {args.name}: ")
        if password != getpass.getpass("again: "):
            print("passwords differ", file=sys.stderr)
            return 1
    store = Store(Path(args.db))
    try:
        user = users.create(store, args.name, password, args.role, replace=args.replace,
                            actor=_cli_actor())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(f"{'updated' if args.replace else 'created'} {user.role} {user.name!r} in {args.db}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m console", description="Sluice ops console")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the console with waitress")
    s.add_argument("--db", default=DEFAULT_DB, help="SQLite file (created with its directory)")
    s.add_argument("--policy", default="policies", help="directory of policy YAML files (the base layer)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    s.add_argument("--api-token", default=None,
                   help="bearer token replicas use (visible in ps: prefer --api-token-file or "
                        "$SLUICE_CONSOLE_TOKEN; default: one stored in the DB)")
    s.add_argument("--api-token-file", default=None,
                   help="read the bearer token from this file (or $SLUICE_CONSOLE_TOKEN_FILE)")
    s.add_argument("--demo", action="store_true",
                   help="create/reset a demo operator (its credentials are printed when the "
                        "password is made up here)")
    s.add_argument("--demo-user", default="demo")
    s.add_argument("--demo-password", default=None,
                   help="default: $SLUICE_CONSOLE_DEMO_PASSWORD, else a random one, printed")
    s.add_argument("--show-token", action="store_true",
                   help="print the replicas' API token at start")
    s.add_argument("--threads", type=int, default=16)
    s.add_argument("--reload-interval", type=float, default=1.0, help="seconds between checks of the files")
    s.add_argument("--secure-cookies", action="store_true", help="session cookie only over HTTPS")
    s.add_argument("--replica-hide-after", type=float, default=None,
                   help="seconds without a report before a replica leaves the pages (default 300)")
    s.add_argument("--replica-forget-after", type=float, default=None,
                   help="seconds without a report before a replica is deleted (default 3600)")
    s.add_argument("--login-concurrency", type=int, default=None,
                   help="password checks (scrypt) run at once; more get 429 (default 1)")
    s.add_argument("--trusted-proxy", action="append", default=[], metavar="CIDR",
                   help="a reverse proxy whose X-Forwarded-For names the client for the login "
                        "throttle (repeatable, or comma-separated in "
                        "$SLUICE_CONSOLE_TRUSTED_PROXIES); default: none, the peer address counts")
    u = sub.add_parser("create-user", help="create an operator or viewer account")
    u.add_argument("name")
    u.add_argument("--role", choices=("operator", "viewer"), required=True)
    u.add_argument("--password", default=None, help="default: $SLUICE_CONSOLE_PASSWORD, else prompt")
    u.add_argument("--db", default=DEFAULT_DB)
    u.add_argument("--replace", action="store_true", help="reset the password and role of an existing user")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "serve":
        return _serve(args)
    return _create_user(args)


if __name__ == "__main__":
    sys.exit(main())
