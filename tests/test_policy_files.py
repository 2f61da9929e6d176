"""Policy schema and YAML loading: every problem reported as file:line: path: message."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.policy.budget import Budget, Price
from extproc.policy.schema import (
    AdaptiveSettings,
    Backend,
    BreakerOverride,
    BreakerSettings,
    Degrade,
    Endpoint,
    Gateway,
    Limits,
    Model,
    PlacementSettings,
    PolicyError,
    Tenant,
    Tier,
    WatermarkSettings,
    build_policy,
    hash_key,
)
from extproc.policyfile import load_policy

REPO = Path(__file__).resolve().parent.parent
H1, H2, H3 = (hash_key(k) for k in ("sk-one", "sk-two", "sk-three"))

GATEWAY = """\
gateway:
  max_body_bytes: 1048576
  default_max_tokens: 256
"""
BACKENDS = """\
backends:
  - name: gpu-a
    address: 127.0.0.1:8000
    max_concurrency: 16
    models:
      - name: llama
        context_window: 8192
      - name: llama-long
        context_window: 32768
        encoding: o200k_base
"""
TIERS = """\
tiers:
  gold:
    priority: 10
    tpm: 6000
    rpm: 60
    max_concurrency: 4
    guaranteed_slots: 4
  free:
    tpm: 600
    rpm: 6
"""
TENANTS = f"""\
tenants:
  - name: acme
    tier: gold
    keys: [{H1}]
  - name: bob
    tier: free
    tpm: 60
    keys:
      - {H2}
"""


def write(d: Path, **files: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / f"{name}.yaml").write_text(text)
    return d


def good(tmp_path: Path, **overrides: str) -> Path:
    files = {"gateway": GATEWAY, "backends": BACKENDS, "tiers": TIERS, "tenants": TENANTS}
    files.update(overrides)
    return write(tmp_path / "pol", **{k: v for k, v in files.items() if v is not None})


def problems(d: Path) -> list[str]:
    with pytest.raises(PolicyError) as ei:
        load_policy(d)
    lines = [str(p) for p in ei.value.problems]
    assert str(ei.value) == "\n".join(lines)
    return lines


def line_of(text: str, needle: str, nth: int = 1) -> int:
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    return hits[nth - 1]


def only(found: list[str], file: Path, line: int, path: str, *words: str) -> None:
    assert len(found) == 1, found
    assert_problem(found[0], file, line, path, *words)


def assert_problem(problem: str, file: Path, line: int, path: str, *words: str) -> None:
    prefix = f"{file}:{line}: {path}: "
    assert problem.startswith(prefix), f"{problem!r} does not start with {prefix!r}"
    for w in words:
        assert w in problem, (w, problem)


# -- the shipped example -------------------------------------------------------------

def test_example_policy_loads() -> None:
    policy = load_policy(REPO / "policies")
    assert policy.backends and policy.tiers and policy.tenants
    for _, (backend, model) in policy.by_model.items():
        assert model in backend.models
    acme = policy.tenant_for_key("sk-demo-premium")
    assert acme is not None and acme.name == "acme"
    assert policy.tenant_for_key("sk-demo-free").name == "hobbyist"  # type: ignore[union-attr]


def test_good_policy(tmp_path: Path) -> None:
    p = load_policy(good(tmp_path))
    assert [b.name for b in p.backends] == ["gpu-a"]
    assert (p.backends[0].host, p.backends[0].port) == ("127.0.0.1", 8000)
    assert p.by_model["llama-long"][1].encoding == "o200k_base"
    assert p.by_model["llama"][1].encoding == "cl100k_base"
    assert p.gateway.default_max_tokens == 256 and p.gateway.strip_api_key is True
    assert p.tiers["free"].burst_tokens == 600  # defaults to one minute of tpm
    assert p.tenants["acme"].key_hashes == (H1,)


def test_limits_apply_tenant_overrides(tmp_path: Path) -> None:
    p = load_policy(good(tmp_path))
    assert p.limits(p.tenants["acme"]) == Limits(tpm=6000, rpm=60, burst_tokens=6000, max_concurrency=4)
    bob = p.limits(p.tenants["bob"])
    assert bob.tpm == 60 and bob.rpm == 6
    assert bob.burst_tokens == 60  # scaled with the tpm override
    assert p.tiers["free"].max_concurrency == bob.max_concurrency
    custom = dataclasses.replace(p.tenants["acme"], rpm=7, max_concurrency=2, tpm=12000)
    lim = p.limits(custom)
    assert (lim.tpm, lim.rpm, lim.max_concurrency, lim.burst_tokens) == (12000, 7, 2, 12000)


def test_tenant_for_key(tmp_path: Path) -> None:
    p = load_policy(good(tmp_path))
    assert p.tenant_for_key("sk-one").name == "acme"  # type: ignore[union-attr]
    assert p.tenant_for_key("sk-two").name == "bob"  # type: ignore[union-attr]
    assert p.tenant_for_key("sk-nope") is None
    assert p.tenant_for_key(H1) is None  # the hash itself is not a key


def test_hash_key_form() -> None:
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", hash_key("sk-x"))
    assert hash_key("sk-x") != hash_key("sk-y")


# -- one mistake each: file, line, path, message ---------------------------------

def test_unknown_field(tmp_path: Path) -> None:
    tiers = TIERS.replace("    rpm: 60\n", "    rpm: 60\n    tmp: 5\n")
    d = good(tmp_path, tiers=tiers)
    only(problems(d), d / "tiers.yaml", line_of(tiers, "tmp:"), "tiers.gold.tmp", "unknown field")


def test_unknown_gateway_field(tmp_path: Path) -> None:
    gw = GATEWAY + "  max_bodybytes: 5\n"
    d = good(tmp_path, gateway=gw)
    only(problems(d), d / "gateway.yaml", 4, "gateway.max_bodybytes", "unknown field", "max_body_bytes")


def test_wrong_type(tmp_path: Path) -> None:
    tiers = TIERS.replace("tpm: 600\n", "tpm: lots\n")
    d = good(tmp_path, tiers=tiers)
    only(problems(d), d / "tiers.yaml", line_of(tiers, "tpm: lots"), "tiers.free.tpm", "expected int", "str")


def test_boolean_is_not_an_int(tmp_path: Path) -> None:
    backends = BACKENDS.replace("max_concurrency: 16", "max_concurrency: true")
    d = good(tmp_path, backends=backends)
    only(problems(d), d / "backends.yaml", line_of(backends, "max_concurrency"),
         "backends[0].max_concurrency", "boolean")


def test_missing_required_field_points_at_parent(tmp_path: Path) -> None:
    backends = BACKENDS.replace("        context_window: 8192\n", "")
    d = good(tmp_path, backends=backends)
    only(problems(d), d / "backends.yaml", line_of(backends, "- name: llama"),
         "backends[0].models[0].context_window", "required")


def test_unknown_tier_for_tenant(tmp_path: Path) -> None:
    tenants = TENANTS.replace("tier: free", "tier: silver")
    d = good(tmp_path, tenants=tenants)
    only(problems(d), d / "tenants.yaml", line_of(tenants, "tier: silver"), "tenants[1].tier",
         "unknown tier 'silver'", "free", "gold")


def test_raw_key_instead_of_hash(tmp_path: Path) -> None:
    tenants = TENANTS.replace(f"      - {H2}\n", f"      - {H2}\n      - sk-live-123\n")
    d = good(tmp_path, tenants=tenants)
    only(problems(d), d / "tenants.yaml", line_of(tenants, "sk-live-123"), "tenants[1].keys[1]",
         "sha256:", "never keys")


def test_uppercase_hash_rejected(tmp_path: Path) -> None:
    upper = "sha256:" + H2[7:].upper()
    tenants = TENANTS.replace(H2, upper)
    d = good(tmp_path, tenants=tenants)
    only(problems(d), d / "tenants.yaml", line_of(tenants, upper), "tenants[1].keys[0]", "lowercase hex")


def test_duplicate_tenant(tmp_path: Path) -> None:
    tenants = TENANTS + f"  - name: acme\n    tier: free\n    keys: [{H3}]\n"
    d = good(tmp_path, tenants=tenants)
    only(problems(d), d / "tenants.yaml", line_of(tenants, "name: acme", 2), "tenants[2].name",
         "duplicate tenant 'acme'")


def test_key_shared_by_two_tenants(tmp_path: Path) -> None:
    tenants = TENANTS + f"  - name: carol\n    tier: free\n    keys:\n      - sk-raw\n      - {H1}\n"
    d = good(tmp_path, tenants=tenants)
    found = problems(d)
    assert len(found) == 2, found
    assert_problem(found[0], d / "tenants.yaml", line_of(tenants, "sk-raw"), "tenants[2].keys[0]", "sha256")
    assert_problem(found[1], d / "tenants.yaml", line_of(tenants, H1, 2), "tenants[2].keys[1]",
                   "already belongs to tenant 'acme'")


def test_key_clash_after_duplicate_tenant_points_at_the_right_item(tmp_path: Path) -> None:
    tenants = (TENANTS + f"  - name: acme\n    tier: gold\n    keys: [{H3}]\n"
               + f"  - name: dave\n    tier: gold\n    keys: [{H3}]\n")
    d = good(tmp_path, tenants=tenants)
    found = problems(d)
    assert len(found) == 2, found
    assert_problem(found[0], d / "tenants.yaml", line_of(tenants, "name: acme", 2), "tenants[2].name",
                   "duplicate")
    assert_problem(found[1], d / "tenants.yaml", line_of(tenants, H3, 2), "tenants[3].keys[0]",
                   "already belongs to tenant 'acme'")


def test_duplicate_model_across_backends(tmp_path: Path) -> None:
    backends = BACKENDS + ("  - name: gpu-b\n    address: 10.0.0.2:8000\n    models:\n"
                           "      - name: other\n        context_window: 4096\n"
                           "      - name: llama\n        context_window: 4096\n")
    d = good(tmp_path, backends=backends)
    only(problems(d), d / "backends.yaml", line_of(backends, "- name: llama", 3),
         "backends[1].models[1].name", "'llama' is already served by backend 'gpu-a'")


def test_duplicate_backend(tmp_path: Path) -> None:
    backends = BACKENDS + ("  - name: gpu-a\n    address: 10.0.0.2:8000\n    models:\n"
                           "      - name: other\n        context_window: 4096\n")
    d = good(tmp_path, backends=backends)
    only(problems(d), d / "backends.yaml", line_of(backends, "- name: gpu-a", 2), "backends[1].name",
         "duplicate backend")


def test_guaranteed_slots_exceed_backend(tmp_path: Path) -> None:
    tiers = TIERS.replace("guaranteed_slots: 4", "guaranteed_slots: 10") + "    guaranteed_slots: 7\n"
    d = good(tmp_path, tiers=tiers)
    only(problems(d), d / "backends.yaml", line_of(BACKENDS, "max_concurrency: 16"),
         "backends[0].max_concurrency", "guarantee 17 slots", "16")


def test_bad_address(tmp_path: Path) -> None:
    backends = BACKENDS.replace("127.0.0.1:8000", "127.0.0.1:99999")
    d = good(tmp_path, backends=backends)
    only(problems(d), d / "backends.yaml", line_of(backends, "address"), "backends[0].address", "host:port")


def test_invalid_yaml(tmp_path: Path) -> None:
    tiers = TIERS.replace("    rpm: 6\n", "    rpm: [6\n")
    d = good(tmp_path, tiers=tiers)
    found = problems(d)
    assert len(found) == 1, found
    m = re.match(rf"{re.escape(str(d / 'tiers.yaml'))}:(\d+): not valid YAML", found[0])
    assert m, found
    assert int(m.group(1)) >= line_of(tiers, "rpm: [6")


def test_not_a_mapping(tmp_path: Path) -> None:
    d = good(tmp_path, tiers="- just\n- a list\n")
    found = problems(d)
    assert found == [f"{d / 'tiers.yaml'}:1: expected a mapping of sections"]


def test_unknown_section(tmp_path: Path) -> None:
    d = good(tmp_path, extra="\n\nlimits:\n  x: 1\n")
    only(problems(d), d / "extra.yaml", 3, "limits", "unknown section")


def test_all_problems_are_reported(tmp_path: Path) -> None:
    tiers = TIERS.replace("tpm: 600\n", "tpm: -5\n").replace("priority: 10", "priority: high")
    tenants = TENANTS.replace("tier: gold", "tier: platinum").replace(f"[{H1}]", "[sk-raw]")
    backends = BACKENDS.replace("127.0.0.1:8000", "nohost")
    d = good(tmp_path, tiers=tiers, tenants=tenants, backends=backends)
    found = problems(d)
    want = [
        ("backends.yaml", backends, "address", "backends[0].address"),
        ("tiers.yaml", tiers, "priority: high", "tiers.gold.priority"),
        ("tiers.yaml", tiers, "tpm: -5", "tiers.free.tpm"),
        ("tenants.yaml", tenants, "platinum", "tenants[0].tier"),
        ("tenants.yaml", tenants, "sk-raw", "tenants[0].keys[0]"),
    ]
    assert len(found) == len(want), found
    for file, text, needle, path in want:
        prefix = f"{d / file}:{line_of(text, needle)}: {path}: "
        assert any(p.startswith(prefix) for p in found), (prefix, found)


# -- sections spread over files ------------------------------------------------------

def test_lists_concatenate_with_lines_in_the_second_file(tmp_path: Path) -> None:
    more = f"# more tenants\n\ntenants:\n  - name: carol\n    tier: gold\n    keys: [{H3}]\n" \
           "  - name: dan\n    tier: bronze\n    keys: [sk-raw-dan]\n"
    d = good(tmp_path, tenants2=more)
    found = problems(d)
    assert len(found) == 2, found
    second = d / "tenants2.yaml"
    assert_problem(found[0], second, line_of(more, "bronze"), "tenants[3].tier", "unknown tier")
    assert_problem(found[1], second, line_of(more, "sk-raw-dan"), "tenants[3].keys[0]", "sha256")


def test_lists_concatenate(tmp_path: Path) -> None:
    more = f"tenants:\n  - name: carol\n    tier: gold\n    keys: [{H3}]\n"
    p = load_policy(good(tmp_path, tenants2=more))
    assert list(p.tenants) == ["acme", "bob", "carol"]
    assert p.tenant_for_key("sk-three").name == "carol"  # type: ignore[union-attr]


def test_tiers_merge_across_files(tmp_path: Path) -> None:
    more = "tiers:\n  bronze:\n    tpm: 100\n    rpm: 1\n"
    p = load_policy(good(tmp_path, tiers2=more))
    assert set(p.tiers) == {"gold", "free", "bronze"}


def test_tier_defined_twice_across_files(tmp_path: Path) -> None:
    more = "tiers:\n  bronze:\n    tpm: 100\n    rpm: 1\n  gold:\n    tpm: 1\n    rpm: 1\n"
    d = good(tmp_path, tiers2=more)
    only(problems(d), d / "tiers2.yaml", 5, "tiers.gold", "defined twice")


def test_gateway_defined_in_two_files(tmp_path: Path) -> None:
    d = good(tmp_path, zgateway="# again\ngateway:\n  strip_api_key: false\n")
    only(problems(d), d / "zgateway.yaml", 2, "gateway", "more than one file")


def test_section_defined_twice_in_one_file(tmp_path: Path) -> None:
    tenants = TENANTS + f"tenants:\n  - name: zed\n    tier: gold\n    keys: [{H3}]\n"
    d = good(tmp_path, tenants=tenants)
    found = problems(d)
    assert len(found) == 1, found
    assert_problem(found[0], d / "tenants.yaml", line_of(tenants, "tenants:", 2), "tenants",
                   "defined twice", f"{d / 'tenants.yaml'}:1")


def test_field_defined_twice_in_one_mapping(tmp_path: Path) -> None:
    tiers = TIERS.replace("    rpm: 60\n", "    rpm: 60\n    rpm: 600\n")
    d = good(tmp_path, tiers=tiers)
    only(problems(d), d / "tiers.yaml", line_of(tiers, "rpm: 600"), "tiers.gold.rpm", "defined twice")


def test_merge_problems_and_schema_problems_together(tmp_path: Path) -> None:
    d = good(tmp_path, zgateway="gateway:\n  strip_api_key: false\n",
             tiers=TIERS.replace("tpm: 600\n", "tpm: many\n"))
    found = problems(d)
    assert len(found) == 2, found
    assert any("more than one file" in p for p in found)
    assert any("tiers.free.tpm" in p for p in found)


def test_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match="no \\*.yaml policy files"):
        load_policy(tmp_path / "empty")


def test_build_policy_without_locator() -> None:
    with pytest.raises(PolicyError) as ei:
        build_policy({"backends": [], "tiers": {}})
    assert [str(p) for p in ei.value.problems] == [
        "<policy>: backends: expected a non-empty list of backends",
        "<policy>: tiers: at least one tier is required",
    ]


# -- the command line -----------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30)


def test_cli_validate_example() -> None:
    r = run_cli("validate", "policies")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok:") and r.stderr == ""


def test_cli_validate_bad_dir(tmp_path: Path) -> None:
    tenants = TENANTS.replace("tier: free", "tier: silver")
    tiers = TIERS.replace("rpm: 6\n", "rpm: six\n")
    d = good(tmp_path, tenants=tenants, tiers=tiers)
    r = run_cli("validate", str(d))
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines == [
        f"{d / 'tiers.yaml'}:{line_of(tiers, 'rpm: six')}: tiers.free.rpm: expected int, got str",
        f"{d / 'tenants.yaml'}:{line_of(tenants, 'silver')}: tenants[1].tier: "
        "unknown tier 'silver' (known: free, gold)",
    ]


def test_cli_hash_key() -> None:
    r = run_cli("hash-key", "sk-demo-premium")
    assert r.returncode == 0
    assert r.stdout.strip() == hash_key("sk-demo-premium")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}\n", r.stdout)


# -- docs -------------------------------------------------------------------------------

# Dataclass fields whose YAML spelling differs.
YAML_NAMES = {(Backend, "host"): "address", (Backend, "port"): "address", (Tenant, "key_hashes"): "keys",
              (Endpoint, "host"): "address", (Endpoint, "port"): "address",
              (Backend, "gpu_hour_cost_nanos"): "gpu_hour_cost", (Budget, "zone"): "time_zone",
              (Budget, "cost_nanos"): "cost"}


POLICY_REFERENCE = REPO / "docs" / "policy.md"


def policy_reference() -> str:
    """The policy reference page, from its title on (the whole page is the reference)."""
    text = POLICY_REFERENCE.read_text(encoding="utf-8")
    m = re.search(r"^# Policy reference$", text, re.MULTILINE)
    assert m, "docs/policy.md has no '# Policy reference' title"
    return text[m.end():]


def test_policy_reference_documents_every_policy_field() -> None:
    section = policy_reference()
    missing = []
    for cls in (Gateway, Model, Backend, Tier, Tenant, WatermarkSettings, BreakerSettings, Degrade,
                BreakerOverride, AdaptiveSettings, Endpoint, PlacementSettings, Budget, Price):
        for f in (f for f in dataclasses.fields(cls) if f.init):  # derived fields are not YAML
            name = YAML_NAMES.get((cls, f.name), f.name)
            if not re.search(rf"\b{re.escape(name)}\b", section):
                missing.append(f"{cls.__name__}.{f.name}" + (f" ({name})" if name != f.name else ""))
    assert not missing, f"docs/policy.md does not mention: {', '.join(missing)}"


def test_breaker_override_must_name_a_model_the_backend_serves() -> None:
    doc = {
        "backends": [{"name": "b", "address": "127.0.0.1:1", "models": [{"name": "m", "context_window": 64}]}],
        "tiers": {"t": {"tpm": 10, "rpm": 1}},
        "tenants": [],
        "breakers": [{"backend": "b", "model": "nope", "state": "open", "reason": "x"}],
    }
    with pytest.raises(PolicyError) as exc:
        build_policy(doc)
    assert "does not serve model 'nope'" in str(exc.value)
    doc["breakers"][0]["model"] = "m"
    assert build_policy(doc).breakers[0].model == "m"
