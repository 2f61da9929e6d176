"""Export (YAML and diff), re-import of changed files, conflicts between files and overrides."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from console import exporter
from tests.console.conftest import POLICY_FILES, Console, MakeConsole, text_of
from tests.console.test_edits import FREE, TENANT


def change_things(c: Console) -> None:
    assert c.post("/tenants/hobbyist", {**TENANT, "tpm": "5000"}).status_code == 200
    assert c.post("/tenants/nightly-etl", {**TENANT, "tier": "batch", "tpm": "", "rpm": "30"}).status_code == 200
    assert c.post("/tiers/free", {**FREE, "max_queue_depth": "16", "degrade.shed_below_scale": "0.5"}
                  ).status_code == 200
    assert c.post("/breakers/sim", {"action": "trip", "reason": "maintenance"}).status_code == 200


def policy_sections(c: Console) -> dict:
    doc = c.policy()
    doc.pop("breakers")
    return doc


def test_export_round_trip(operator: Console, make_console: MakeConsole, tmp_path: Path) -> None:
    change_things(operator)
    r = operator.client.get("/export/policy.yaml")
    assert r.status_code == 200 and r.mimetype == "application/yaml"
    assert "attachment" in r.headers["Content-Disposition"]
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    (fresh_dir / "policy.yaml").write_text(r.get_data(as_text=True))
    fresh = make_console(policy_dir=fresh_dir)
    assert policy_sections(fresh) == policy_sections(operator)
    assert fresh.policy()["breakers"] == []  # manual breakers are not part of the files


def test_diff_keeps_comments_and_applies_with_git(operator: Console, make_console: MakeConsole,
                                                  tmp_path: Path) -> None:
    change_things(operator)
    exports = {e.name: e for e in exporter.files(operator.sluice.state.snapshot(), "policies")}
    assert all(e.patched for e in exports.values())
    assert not exports["gateway.yaml"].changed and not exports["backends.yaml"].changed
    tenants = exports["tenants.yaml"].after
    assert "# Tenants; keys are sha256 hashes." in tenants and "# the free plan" in tenants
    assert "-    tier: free             # the free plan" in exports["tenants.yaml"].diff
    assert "+    tier: premium             # the free plan" in exports["tenants.yaml"].diff
    assert "tpm: 100000" not in tenants and "rpm: 30" in tenants
    tiers = exports["tiers.yaml"].after
    assert "max_concurrency: 32        # per tenant" in tiers
    assert yaml.safe_load(tiers)["tiers"]["free"]["degrade"] == {"shed_below_scale": 0.5}

    # The downloadable diff applies to the files with git, and gives the same policy.
    repo = tmp_path / "repo"
    shutil.copytree(operator.policy_dir, repo / operator.policy_dir.name)
    diff = operator.client.get("/export/policy.diff").get_data(as_text=True)
    (repo / "console.diff").write_text(diff)
    done = subprocess.run(["git", "apply", "console.diff"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + diff
    applied = make_console(policy_dir=repo / operator.policy_dir.name)
    assert policy_sections(applied) == policy_sections(operator)


def test_export_page(operator: Console) -> None:
    change_things(operator)
    page = operator.client.get("/export")
    assert page.status_code == 200
    text = text_of(page)
    assert "tenant hobbyist.tier" in text and "olga" in text and "moving to premium" in text
    assert "tier free.degrade.shed_below_scale" in text
    assert "+ tier: premium" in text.replace("+    ", "+ ")
    assert "breaker sim.manual" in text


def test_file_change_is_reimported_and_audited(operator: Console) -> None:
    operator.write_file("gateway.yaml", POLICY_FILES["gateway.yaml"].replace("128", "64"))
    assert operator.policy()["gateway"]["default_max_tokens"] == 64
    entry = operator.audit_rows()[-1]
    assert (entry["actor"], entry["kind"]) == ("files", "policy.import")
    assert len(operator.sluice.store.query("SELECT * FROM imports")) == 2


def test_conflicts_after_reimport(operator: Console) -> None:
    change_things(operator)
    text = POLICY_FILES["tenants.yaml"]
    # hobbyist's tier changed in git (conflict "changed"), nightly-etl is gone (conflict "missing").
    text = text.replace("tier: free             # the free plan", "tier: batch")
    text = text[: text.index("  - name: nightly-etl")]
    operator.write_file("tenants.yaml", text)
    snap = operator.sluice.state.snapshot()
    kinds = sorted((c.kind, c.override.target, c.override.field) for c in snap.conflicts)
    assert kinds == [("changed", "hobbyist", "tier"), ("missing", "nightly-etl", "rpm"),
                     ("missing", "nightly-etl", "tpm")]
    # "changed" still applies the operator's value; "missing" cannot.
    assert {t["name"]: t["tier"] for t in operator.policy()["tenants"]} == {"acme": "premium",
                                                                           "hobbyist": "premium"}
    page = text_of(operator.client.get("/export"))
    assert "the files changed hobbyist.tier from 'free' to 'batch'" in page
    assert "tenant 'nightly-etl' is no longer in the policy files" in page
    assert "3 override(s) conflict" in text_of(operator.client.get("/"))


def test_override_that_no_longer_validates_is_set_aside(operator: Console) -> None:
    assert operator.post("/tiers/free", {**FREE, "guaranteed_slots": "40"}).status_code == 200
    # The files now guarantee more to premium: 40 + 30 > 64.
    operator.write_file("tiers.yaml", POLICY_FILES["tiers.yaml"].replace("guaranteed_slots: 24",
                                                                         "guaranteed_slots: 30"))
    snap = operator.sluice.state.snapshot()
    [conflict] = snap.conflicts
    assert conflict.kind == "invalid" and "tiers guarantee 70 slots" in conflict.message
    assert "guaranteed_slots" not in operator.policy()["tiers"]["free"]  # served without it, still valid


def test_revert_and_keep(operator: Console) -> None:
    change_things(operator)
    operator.write_file("tenants.yaml", POLICY_FILES["tenants.yaml"].replace(
        "tier: free             # the free plan", "tier: batch"))
    snap = operator.sluice.state.snapshot()
    changed = next(c for c in snap.conflicts if c.kind == "changed")
    r = operator.post(f"/overrides/{changed.override.id}/keep", {"reason": ""})
    assert r.status_code == 422 and "say why" in r.get_data(as_text=True)
    r = operator.post(f"/overrides/{changed.override.id}/keep", {"reason": "premium is right"})
    assert r.status_code == 200
    snap = operator.sluice.state.snapshot()
    assert not [c for c in snap.conflicts if c.kind == "changed"]
    assert {t["name"]: t["tier"] for t in operator.policy()["tenants"]}["hobbyist"] == "premium"
    assert operator.audit_rows()[-1]["kind"] == "override.keep"

    tpm = next(o for o in snap.overrides if o.target == "hobbyist" and o.field == "tpm")
    r = operator.post(f"/overrides/{tpm.id}/revert", {"reason": "back to the tier's"})
    assert r.status_code == 200
    assert "tpm" not in {t["name"]: t for t in operator.policy()["tenants"]}["hobbyist"]
    assert operator.audit_rows()[-1]["kind"] == "override.revert"


def test_invalid_files_keep_the_last_good_policy(operator: Console) -> None:
    etag = operator.api("GET", "/api/v1/policy").headers["ETag"]
    operator.write_file("tiers.yaml", POLICY_FILES["tiers.yaml"].replace("tpm: 20000", "tpm: -1"))
    assert operator.api("GET", "/api/v1/policy").headers["ETag"] == etag
    text = text_of(operator.client.get("/"))
    assert "do not validate" in text and "must be >= 1, got -1" in text
    assert operator.audit_rows()[-1]["kind"] == "policy.import_failed"
    operator.write_file("tiers.yaml", "tiers: [unclosed")
    assert "not valid YAML" in text_of(operator.client.get("/"))
    operator.write_file("tiers.yaml", POLICY_FILES["tiers.yaml"])
    assert "do not validate" not in text_of(operator.client.get("/"))


def test_broken_files_at_start_fall_back_to_the_last_import(console: Console, make_console: MakeConsole) -> None:
    etag = console.api("GET", "/api/v1/policy").headers["ETag"]
    db = console.sluice.config.db_path
    console.sluice.close()
    (console.policy_dir / "tiers.yaml").write_text("tiers: {}\n")
    again = make_console(db=db, policy_dir=console.policy_dir)
    assert again.api("GET", "/api/v1/policy").headers["ETag"] == etag
    assert again.sluice.state.base_problems


def test_no_policy_at_all(make_console: MakeConsole, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    c = make_console(policy_dir=empty)
    r = c.api("GET", "/api/v1/policy")
    assert r.status_code == 503 and "no *.yaml policy files" in r.get_json()["error"]["message"]
    c.login("olga")
    for path in ("/", "/tenants", "/tiers", "/breakers", "/export", "/audit"):
        assert c.client.get(path).status_code == 200, path
    assert "No valid policy" in text_of(c.client.get("/"))


@pytest.mark.parametrize("value,text", [("free", "free"), ("two words", '"two words"'), ("123", '"123"'),
                                        (5, "5"), (0.5, "0.5"), ("yes", '"yes"')])
def test_scalar_rendering(value: object, text: str) -> None:
    assert exporter.scalar(value) == text
    assert yaml.safe_load(f"k: {text}")["k"] == value
