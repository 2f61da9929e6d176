"""python -m console create-user / serve."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from console import users
from console.__main__ import main
from console.store import Store
from tests.console.conftest import write_policy
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


def test_create_user(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "var" / "console.db"
    assert main(["create-user", "ana", "--role", "operator", "--password", "long-enough-1", "--db", str(db)]) == 0
    assert "created operator 'ana'" in capsys.readouterr().out
    assert main(["create-user", "ana", "--role", "viewer", "--password", "long-enough-1", "--db", str(db)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["create-user", "ana", "--role", "viewer", "--password", "long-enough-2", "--db", str(db),
                 "--replace"]) == 0
    assert main(["create-user", "bo", "--role", "viewer", "--password", "short", "--db", str(db)]) == 1
    store = Store(db)
    user = users.authenticate(store, "ana", "long-enough-2")
    assert user is not None and user.role == "viewer"
    stored = store.one("SELECT password_hash FROM users WHERE name = 'ana'")
    assert stored is not None and stored["password_hash"].startswith("scrypt:")
    assert users.authenticate(store, "ana", "long-enough-1") is None


def test_create_user_password_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CONSOLE_PASSWORD", "from-the-env-1")
    db = tmp_path / "c.db"
    assert main(["create-user", "cy", "--role", "operator", "--db", str(db)]) == 0
    store = Store(db)
    assert users.authenticate(store, "cy", "from-the-env-1") is not None


def test_serve_demo_with_waitress(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policies")
    proc = subprocess.Popen(
        [sys.executable, "-m", "console", "serve", "--db", str(tmp_path / "c.db"), "--policy", str(policy),
         "--port", "0", "--demo", "--api-token", "tok-123", "--show-token"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        url = re.search(r"(http://127\.0\.0\.1:\d+)/", lines[0])
        assert url, lines
        assert re.match(r"\s+demo operator: demo / \S+", lines[1]), lines
        assert "replica API token: tok-123" in lines[2]
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(url.group(1) + "/healthz", timeout=1) as r:
                    assert json.loads(r.read()) == {"status": "ok"}
                    assert r.headers["Server"] == "sluice-console"
                return True
            except OSError:
                return False

        eventually(healthy, 10, "the console's /healthz")
        req = urllib.request.Request(url.group(1) + "/api/v1/policy", headers={"Authorization": "Bearer tok-123"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert "tenants" in json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def test_serve_demo_keeps_a_given_password_and_the_token_out_of_the_terminal(
        tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policies")
    env = {**os.environ, "SLUICE_CONSOLE_DEMO_PASSWORD": "chosen-by-the-demo",
           "SLUICE_CONSOLE_TOKEN": "tok-456"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "console", "serve", "--db", str(tmp_path / "c.db"),
         "--policy", str(policy), "--port", "0", "--demo"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/", first)
        assert url, first
        # The line is printed once the socket is bound: /healthz answers from here on.
        with urllib.request.urlopen(url.group(1) + "/healthz", timeout=5) as r:
            assert r.status == 200
        store = Store(tmp_path / "c.db")
        assert users.authenticate(store, "demo", "chosen-by-the-demo") is not None
        store.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert "chosen-by-the-demo" not in first + out and "tok-456" not in first + out
    assert "demo operator" not in first + out


def test_every_option_is_documented_on_the_console_page() -> None:
    import argparse

    from console.__main__ import build_parser

    section = (ROOT / "docs" / "console.md").read_text()
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert f"python -m console {name}" in section, name
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in section, f"{name} {option} is not in docs/console.md"


def _server_has_read(server_port: int, client_port: int) -> bool:
    """The console's end of this connection has nothing left unread: it took the request."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, _, queues = line.split()[1:5]
        ours = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16))
        if ours == (server_port, client_port):
            return int(queues.split(":")[1], 16) == 0
    return False


def test_sigterm_releases_long_polls_and_stops_quietly(tmp_path: Path) -> None:
    import http.client
    import threading
    import time

    policy = write_policy(tmp_path / "policies")
    proc = subprocess.Popen(
        [sys.executable, "-m", "console", "serve", "--db", str(tmp_path / "c.db"),
         "--policy", str(policy), "--port", "0", "--api-token", "tok-123"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    url = re.search(r"http://127\.0\.0\.1:(\d+)/", proc.stdout.readline())
    assert url
    port = int(url.group(1))
    auth = {"Authorization": "Bearer tok-123"}
    first = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    first.request("GET", "/api/v1/policy", headers=auth)
    etag = first.getresponse().headers["ETag"]
    first.close()
    poll = http.client.HTTPConnection("127.0.0.1", port, timeout=40)
    poll.request("GET", "/api/v1/policy?wait=30", headers={**auth, "If-None-Match": etag})
    assert poll.sock is not None
    client_port = poll.sock.getsockname()[1]
    eventually(lambda: _server_has_read(port, client_port), 10, "the console reading the long-poll")
    answered: list[int] = []
    t = threading.Thread(target=lambda: answered.append(poll.getresponse().status))
    t.start()
    started = time.monotonic()
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    t.join(10)
    assert time.monotonic() - started < 4, f"the console waited the long-poll out: {answered} {out}"
    assert answered == [304]
    assert "still running" not in out and "Traceback" not in out, out
