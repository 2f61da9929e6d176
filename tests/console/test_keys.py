"""Tenants and keys from the console: created, issued (shown once, stored as sha256),
revoked, rotated; audited, served by the policy API, exported to YAML; operators only."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from console import exporter, validation
from extproc.policy.schema import hash_key
from tests.console.conftest import Console, MakeConsole, text_of

KEY = re.compile(r"sk-sluice-[A-Za-z0-9_-]{43}")


def create(c: Console, name: str = "newco", tier: str = "free", reason: str = "signed up", **kw: Any) -> Any:
    return c.post("/tenants", {"name": name, "tier": tier, "reason": reason}, **kw)


def shown_key(r: Any) -> str:
    keys = KEY.findall(r.get_data(as_text=True))
    assert len(set(keys)) == 1, keys
    return keys[0]


def tenant_of(c: Console, api_key: str) -> str | None:
    """What a replica does with the policy it gets: build it and look the key up."""
    t = validation.build(c.policy()).tenant_for_key(api_key)
    return t.name if t else None


def test_create_tenant_issues_a_key_shown_once(operator: Console) -> None:
    r = create(operator)
    assert r.status_code == 201, r.text
    assert r.headers["HX-Trigger"] == "tenants-changed"
    key = shown_key(r)
    assert "shown once" in text_of(r)
    doc = operator.policy()
    newco = next(t for t in doc["tenants"] if t["name"] == "newco")
    assert newco == {"name": "newco", "tier": "free", "keys": [hash_key(key)]}
    assert tenant_of(operator, key) == "newco"
    # the key itself is stored nowhere: not in any table, not on a later page
    store = operator.sluice.store
    for table in [r["name"] for r in store.query("SELECT name FROM sqlite_master WHERE type = 'table'")]:
        for row in store.query(f"SELECT * FROM [{table}]"):
            assert key not in repr(row), table
    assert key not in operator.client.get("/tenants/newco/keys").get_data(as_text=True)
    assert key not in operator.client.get("/tenants").get_data(as_text=True)
    entry = [a for a in operator.audit_rows() if a["kind"] == "tenant.create"]
    assert len(entry) == 1 and entry[0]["actor"] == "olga" and entry[0]["target"] == "newco"
    assert entry[0]["reason"] == "signed up" and hash_key(key) in entry[0]["detail"]
    table = operator.client.get("/tenants/table", headers={"HX-Request": "true"})
    assert 'id="tenant-newco"' in table.get_data(as_text=True) and "new" in text_of(table)


def test_create_without_htmx_shows_the_key_on_the_page(operator: Console) -> None:
    r = create(operator, htmx=False)
    assert r.status_code == 201
    assert tenant_of(operator, shown_key(r)) == "newco"
    assert "<h1>Tenants</h1>" in r.get_data(as_text=True)


def test_create_is_validated_by_the_schema(operator: Console) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    audit_before = len(operator.audit_rows())
    for data, field, message in (
        ({"name": "Bad Name!"}, "name", "not a valid name"),
        ({"tier": "platinum"}, "tier", "unknown tier"),
        ({"name": "acme"}, "name", "already exists"),
        ({"reason": ""}, "reason", "say why"),
    ):
        r = operator.post("/tenants", {"name": "newco", "tier": "free", "reason": "x", **data})
        assert r.status_code == 422, (data, r.status_code)
        assert r.headers["HX-Retarget"] == "#tenant-new"
        body = r.get_data(as_text=True)
        assert re.search(rf'data-field="{field}">[^<]*{message}', body), (data, body)
        assert not KEY.search(body)
    assert operator.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert len(operator.audit_rows()) == audit_before


def test_issue_revoke_and_rotate(operator: Console) -> None:
    first = shown_key(create(operator))
    r = operator.post("/tenants/newco/keys", {"reason": "second app"})
    assert r.status_code == 201
    second = shown_key(r)
    assert second != first
    assert tenant_of(operator, first) == tenant_of(operator, second) == "newco"
    r = operator.post(f"/tenants/newco/keys/{hash_key(first)[7:]}/revoke", {"reason": "leaked in a log"})
    assert r.status_code == 200 and "revoked" in text_of(r)
    assert tenant_of(operator, first) is None and tenant_of(operator, second) == "newco"
    assert hash_key(first) not in str(operator.policy())
    # the last key cannot be revoked: the tenant would have none (rotate instead)
    r = operator.post(f"/tenants/newco/keys/{hash_key(second)[7:]}/revoke", {"reason": "oops"})
    assert r.status_code == 422 and "at least one key" in text_of(r)
    assert tenant_of(operator, second) == "newco"
    r = operator.post(f"/tenants/newco/keys/{hash_key(second)[7:]}/rotate", {"reason": "quarterly rotation"})
    assert r.status_code == 201
    third = shown_key(r)
    assert tenant_of(operator, second) is None and tenant_of(operator, third) == "newco"
    kinds = [(a["kind"], a["target"]) for a in operator.audit_rows() if a["kind"].startswith(("key.", "tenant."))]
    assert kinds == [("tenant.create", "newco"), ("key.issue", "newco"), ("key.revoke", "newco"),
                     ("key.rotate", "newco")]


def test_keys_from_the_files_can_be_rotated_and_the_export_shows_it(operator: Console,
                                                                    make_console: MakeConsole,
                                                                    tmp_path: Path) -> None:
    assert tenant_of(operator, "sk-acme") == "acme"
    panel = operator.client.get("/tenants/acme/keys", headers={"HX-Request": "true"})
    assert hash_key("sk-acme")[:19] in panel.get_data(as_text=True) and "files" in text_of(panel)
    r = operator.post(f"/tenants/acme/keys/{hash_key('sk-acme')[7:]}/rotate", {"reason": "rotate the demo key"})
    assert r.status_code == 201
    new = shown_key(r)
    assert tenant_of(operator, "sk-acme") is None and tenant_of(operator, new) == "acme"
    shown_key(create(operator, "newco", "batch"))
    exports = {e.name: e for e in exporter.files(operator.sluice.state.snapshot(), "policies")}
    tenants = exports["tenants.yaml"]
    assert tenants.patched, tenants.after
    assert "# the free plan" in tenants.after  # comments kept
    data = yaml.safe_load(tenants.after)["tenants"]
    acme = next(t for t in data if t["name"] == "acme")
    assert acme["keys"] == [hash_key(new)]
    assert next(t for t in data if t["name"] == "newco")["tier"] == "batch"
    assert "newco" in operator.client.get("/export/policy.yaml").get_data(as_text=True)
    # the diff applies with git and the files then say what the console serves
    repo = tmp_path / "repo"
    shutil.copytree(operator.policy_dir, repo / operator.policy_dir.name)
    (repo / "console.diff").write_text(operator.client.get("/export/policy.diff").get_data(as_text=True))
    done = subprocess.run(["git", "apply", "console.diff"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    applied = make_console(policy_dir=repo / operator.policy_dir.name)
    assert applied.policy()["tenants"] == operator.policy()["tenants"]
    # once the files hold them, the console's overrides change nothing (the files caught up)
    operator.write_file("tenants.yaml", (repo / operator.policy_dir.name / "tenants.yaml").read_text())
    assert operator.policy()["tenants"] == applied.policy()["tenants"]
    assert not operator.sluice.state.snapshot().conflicts


def test_export_page_lists_key_overrides_and_revert_restores(operator: Console) -> None:
    r = operator.post(f"/tenants/acme/keys/{hash_key('sk-acme')[7:]}/rotate", {"reason": "rotate"})
    new = shown_key(r)
    text = text_of(operator.client.get("/export"))
    assert "key acme." in text
    snap = operator.sluice.state.snapshot()
    removal = next(o for o in snap.overrides if o.scope == "key" and o.value is None)
    assert operator.post(f"/overrides/{removal.id}/revert", {"reason": "keep the old key too"}).status_code == 200
    assert tenant_of(operator, "sk-acme") == "acme" and tenant_of(operator, new) == "acme"


def test_a_created_tenant_survives_an_unrelated_invalid_override(operator: Console) -> None:
    key = shown_key(create(operator))
    assert operator.post("/tenants/hobbyist", {"tier": "premium", "tpm": "", "rpm": "", "max_concurrency": "",
                                               "reason": "upgrade"}).status_code == 200
    # the files drop the premium tier: the hobbyist override no longer validates, newco still does
    tiers = operator.policy_dir / "tiers.yaml"
    text = tiers.read_text()
    operator.write_file("tiers.yaml", text.replace("  premium:", "  gold:"))
    operator.write_file("tenants.yaml", (operator.policy_dir / "tenants.yaml").read_text()
                        .replace("tier: premium", "tier: gold"))
    kinds = {(c.override.scope, c.kind) for c in operator.sluice.state.snapshot().conflicts}
    assert ("tenant", "invalid") in kinds
    assert tenant_of(operator, key) == "newco"


def test_viewer_cannot_manage_keys(viewer: Console) -> None:
    etag = viewer.api("GET", "/api/v1/policy").headers["ETag"]
    for url, data in (("/tenants", {"name": "newco", "tier": "free", "reason": "x"}),
                      ("/tenants/acme/keys", {"reason": "x"}),
                      (f"/tenants/acme/keys/{hash_key('sk-acme')[7:]}/revoke", {"reason": "x"}),
                      (f"/tenants/acme/keys/{hash_key('sk-acme')[7:]}/rotate", {"reason": "x"})):
        for htmx in (True, False):
            r = viewer.post(url, data, htmx=htmx)
            assert r.status_code == 403, url
            assert not KEY.search(r.get_data(as_text=True))
    assert viewer.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert not [a for a in viewer.audit_rows() if a["kind"].startswith(("key.", "tenant."))]
    page = viewer.client.get("/tenants/acme/keys").get_data(as_text=True)
    assert "Revoke" not in page and "Issue a new key" not in page and "New tenant" not in page


def test_reverting_a_created_tenant_takes_its_keys_along(operator: Console) -> None:
    key = shown_key(create(operator))
    created = next(o for o in operator.sluice.state.snapshot().overrides if o.scope == "tenant_new")
    assert operator.post(f"/overrides/{created.id}/revert", {"reason": "signed up by mistake"}).status_code == 200
    snap = operator.sluice.state.snapshot()
    assert tenant_of(operator, key) is None and "newco" not in snap.policy.tenants
    assert not snap.conflicts and not [o for o in snap.overrides if o.target == "newco"]


def test_migration_keeps_existing_overrides_and_allows_the_new_scopes(tmp_path: Path) -> None:
    import sqlite3

    from sqlite_utils import Database

    from console import migrations

    db = Database(sqlite3.connect(str(tmp_path / "old.db")))
    migrations.apply(db, migrations.MIGRATIONS[:1])
    db.execute("INSERT INTO overrides (scope, target, field, value, actor, at, reason) "
               "VALUES ('tenant', 'acme', 'tpm', '5', 'olga', 1.0, 'r')")
    db.conn.commit()
    assert migrations.apply(db) == [mid for mid, _, _ in migrations.MIGRATIONS[1:]]
    assert [(r["id"], r["scope"], r["value"]) for r in db.query("SELECT * FROM overrides")] == [(1, "tenant", "5")]
    db.execute("INSERT INTO overrides (scope, target, field, value, actor, at, reason) "
               "VALUES ('key', 'acme', 'sha256:x', NULL, 'olga', 2.0, 'r')")
    with pytest.raises(sqlite3.IntegrityError):  # the scope CHECK constraint is still there
        db.execute("INSERT INTO overrides (scope, target, field, value, actor, at, reason) "
                   "VALUES ('bogus', 'acme', 'x', NULL, 'olga', 2.0, 'r')")
    db.close()
