"""Console tests: Flask's test client over real SQLite files; every DB closed after each test."""

from __future__ import annotations

import html
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from console import users
from console.app import Sluice, create_app
from console.config import ConsoleConfig
from console.store import Store
from extproc.policy.schema import hash_key

TOKEN = "test-api-token-0123456789"
FAST_HASH = "pbkdf2:sha256:1000"
PASSWORDS = {"olga": "operator-pass-1", "vic": "viewer-pass-1"}

POLICY_FILES = {
    "gateway.yaml": """\
# Gateway-wide limits.
gateway:
  max_body_bytes: 262144
  default_max_tokens: 128
""",
    "backends.yaml": """\
backends:
  - name: sim
    address: 127.0.0.1:8000
    metrics_url: http://127.0.0.1:8000/metrics
    max_concurrency: 64        # the engine's batch size
    models:
      - name: sim-llama-8b
        context_window: 4096
""",
    "tiers.yaml": """\
# Service tiers.
tiers:
  premium:
    priority: 100
    tpm: 200000
    rpm: 600
    max_concurrency: 32        # per tenant
    guaranteed_slots: 24       # per backend
  free:
    priority: 10
    tpm: 20000
    rpm: 60
    max_concurrency: 8
  batch:
    priority: 0
    tpm: 400000
    rpm: 120
""",
    "tenants.yaml": f"""\
# Tenants; keys are sha256 hashes.
tenants:
  - name: acme
    tier: premium
    keys: [{hash_key("sk-acme")}]
  - name: hobbyist
    tier: free             # the free plan
    keys: [{hash_key("sk-hobby")}]
  - name: nightly-etl
    tier: batch
    tpm: 100000
    keys: [{hash_key("sk-etl")}]
""",
}


class Clock:
    """Wall time the test moves by assignment; the app reads it through config.clock."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Console:
    app: Flask
    client: FlaskClient
    policy_dir: Path
    clock: Clock
    opened: list[Store] = field(default_factory=list)

    @property
    def sluice(self) -> Sluice:
        ext: Sluice = self.app.extensions["sluice"]
        return ext

    def new_client(self) -> FlaskClient:
        return self.app.test_client()

    def login(self, name: str = "olga", client: FlaskClient | None = None) -> FlaskClient:
        c = client or self.client
        c.get("/login")
        r = c.post("/login", data={"name": name, "password": PASSWORDS[name], "csrf_token": csrf(c)})
        assert r.status_code == 303, r.text
        return c

    def post(self, url: str, data: dict[str, Any] | None = None, *, htmx: bool = True,
             client: FlaskClient | None = None, token: str | None = None) -> TestResponse:
        """A state change the way the page sends it: the CSRF token in the header (htmx) or form."""
        c = client or self.client
        t = csrf(c) if token is None else token
        form = dict(data or {})
        headers = {}
        if htmx:
            headers = {"HX-Request": "true", "X-CSRF-Token": t}
        else:
            form["csrf_token"] = t
        return c.post(url, data=form, headers=headers)

    def api(self, method: str, url: str, *, token: str = TOKEN, **kw: Any) -> TestResponse:
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        return self.client.open(url, method=method, headers=headers, **kw)

    def policy(self) -> dict[str, Any]:
        r = self.api("GET", "/api/v1/policy")
        assert r.status_code == 200
        return r.get_json()

    def audit_rows(self) -> list[dict[str, Any]]:
        return self.sluice.store.query("SELECT * FROM audit ORDER BY id")

    def write_file(self, name: str, text: str) -> None:
        """Edit a policy file and make sure the next request notices (mtime granularity)."""
        path = self.policy_dir / name
        path.write_text(text)
        self.sluice.state.check_files(force=True)


def csrf(client: FlaskClient) -> str:
    with client.session_transaction() as sess:
        token = sess.get("csrf")
    if token is None:
        client.get("/login")
        with client.session_transaction() as sess:
            token = sess.get("csrf")
    return str(token)


def text_of(resp: TestResponse) -> str:
    """The visible text, roughly: tags dropped, whitespace collapsed."""
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", resp.get_data(as_text=True)).split()))


def write_policy(directory: Path, files: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (files or POLICY_FILES).items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Users are created once, with a cheap hash: scrypt costs ~0.1 s per login."""
    path = tmp_path_factory.mktemp("template") / "console.db"
    store = Store(path)
    try:
        users.create(store, "olga", PASSWORDS["olga"], "operator", method=FAST_HASH)
        users.create(store, "vic", PASSWORDS["vic"], "viewer", method=FAST_HASH)
    finally:
        store.close()
    return path


@pytest.fixture(autouse=True)
def close_databases(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Store]]:
    """Every Store opened during a test is closed after it, whoever opened it."""
    opened: list[Store] = []
    original = Store.__init__

    def tracking_init(self: Store, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(Store, "__init__", tracking_init)
    yield opened
    for store in opened:
        store.close()


MakeConsole = Callable[..., Console]


@pytest.fixture
def make_console(tmp_path: Path, template_db: Path) -> MakeConsole:
    count = 0

    def make(*, policy_files: dict[str, str] | None = None, policy_dir: Path | None = None,
             db: Path | None = None, **cfg: Any) -> Console:
        nonlocal count
        count += 1
        if policy_dir is None:
            policy_dir = write_policy(tmp_path / f"policies{count}", policy_files)
        if db is None:
            db = tmp_path / f"console{count}.db"
            shutil.copy(template_db, db)
        clock = cfg.pop("clock", None) or Clock()
        cfg = {"api_token": TOKEN, "secret_key": "test-secret", "reload_interval": 0.0, **cfg}
        config = ConsoleConfig(db_path=db, policy_dir=policy_dir, clock=clock, **cfg)
        app = create_app(config)
        app.config["TESTING"] = True
        return Console(app, app.test_client(), policy_dir, clock)

    return make


@pytest.fixture
def console(make_console: MakeConsole) -> Console:
    return make_console()


@pytest.fixture
def operator(console: Console) -> Console:
    console.login("olga")
    return console


@pytest.fixture
def viewer(console: Console) -> Console:
    console.login("vic")
    return console
