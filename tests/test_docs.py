"""The documentation checks itself: the site builds strictly (links, anchors, nav), the README
stays a front door, and the pages name every module, metric and CLI option that exists, and
only files, modules and metrics that exist."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify

from extproc.__main__ import main as extproc_main
from extproc.policy.reasons import Reason
from extproc.policy.schema import Gateway
from extproc.runtime.metrics import Metrics
from tests.test_policy_breaker_settings import _shown

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
# Names that look like metrics but are not: the ext_proc cluster in Envoy's config, and a
# configuration of bench.pool.
NOT_METRICS = {"sluice_extproc", "sluice_prefix_sticky"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?:[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|yml|sh|png|json|toml|html)")


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120)


def test_site_builds_strictly(tmp_path: Path) -> None:
    r = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


def test_a_broken_anchor_or_an_unlisted_page_fails_the_build(tmp_path: Path) -> None:
    # The strictness lives in mkdocs.yml (validation: ... warn); a config that lost it would
    # let links rot while test_site_builds_strictly stays green.
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    config = yaml.safe_load(text(ROOT / "mkdocs.yml"))
    config["docs_dir"] = str(docs)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    with (docs / "errors.md").open("a") as f:
        f.write("\nSee [nowhere](pools.md#no-such-section).\n")
    r = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0 and "no-such-section" in r.stderr
    (docs / "errors.md").write_text(text(DOCS / "errors.md"))
    (docs / "orphan.md").write_text("# Orphan\n")
    r = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0 and "orphan.md" in r.stderr


def test_readme_is_a_front_door() -> None:
    readme = text(README)
    assert len(readme.splitlines()) <= 250
    # The two commands a fresh clone needs; .ci/run calls the second.
    assert "make demo" in readme and "make test" in readme


def headings(path: Path) -> set[str]:
    out = set()
    in_code = False
    for line in text(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*)", line)):
            out.add(slugify(m.group(1).strip(), "-"))
    return out


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_links_outside_the_site_resolve(name: str) -> None:
    # mkdocs checks the pages under docs/; these sit outside, so their links are checked here.
    page = ROOT / name
    broken = []
    for target in LINK.findall(text(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else page
        if not file.exists() or (anchor and anchor not in headings(file)):
            broken.append(target)
    assert not broken, f"{name} links to what does not exist: {broken}"


def module_map() -> set[str]:
    page = text(DOCS / "architecture.md")
    section = page[page.index("## Module map"):page.index("## Outside extproc/")]
    return set(re.findall(r"`(extproc/[\w/]+\.py)`", section))


def test_module_map_names_every_module_and_only_those() -> None:
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "extproc").rglob("*.py")}
    mapped = module_map()
    assert not modules - mapped, f"docs/architecture.md's module map lacks: {sorted(modules - mapped)}"
    assert not mapped - modules, f"docs/architecture.md's module map names what is gone: {sorted(mapped - modules)}"


def metric_names() -> set[str]:
    return {fam.name + ("_total" if fam.type == "counter" else "") for fam in Metrics().registry.collect()}


def test_every_metric_is_on_the_metrics_page() -> None:
    page = text(DOCS / "metrics.md")
    missing = sorted(n for n in metric_names() if f"`{n}`" not in page)
    assert not missing, f"docs/metrics.md does not list: {missing}"


def test_pages_name_only_metrics_that_exist() -> None:
    known = metric_names() | NOT_METRICS
    unknown = {}
    for page in [README, *PAGES]:
        for name in set(re.findall(r"\bsluice_[a-z_]+[a-z]", text(page))) - known:
            unknown.setdefault(name, page.relative_to(ROOT).as_posix())
    assert not unknown, f"no such metric: {unknown}"


def named_paths(page: Path) -> set[str]:
    return {m.group(0) for code in CODE.findall(text(page)) if (m := PATH.fullmatch(code.strip()))}


def test_pages_name_only_files_that_exist() -> None:
    missing = {}
    for page in [README, *PAGES]:
        for path in named_paths(page):
            if not path.startswith(("var/", "site/")) and not (ROOT / path).exists():
                missing[path] = page.relative_to(ROOT).as_posix()
    assert not missing, f"no such file: {missing}"


def resolves(dotted: str) -> bool:
    """``extproc.a.b.name``: the longest prefix naming a package or module names at least one
    of extproc's packages or modules, and nothing after it is a package that does not exist."""
    parts = dotted.split(".")
    found = 0
    for i in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:i])
        if base.is_dir() or base.with_suffix(".py").exists():
            found = i
    return found >= 2


def test_pages_name_only_modules_that_exist() -> None:
    missing = {}
    for page in [README, *PAGES]:
        for code in CODE.findall(text(page)):
            for dotted in re.findall(r"\bextproc(?:\.\w+)+", code):
                if not resolves(dotted):
                    missing[dotted] = page.relative_to(ROOT).as_posix()
    assert not missing, f"no such module: {missing}"


def cli_help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        extproc_main([*argv, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("command", ["serve", "validate", "envoy-config", "hash-key"])
def test_every_extproc_option_is_on_the_command_line_page(command: str) -> None:
    page = text(DOCS / "cli.md")
    assert f"## {command}\n" in page
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", cli_help(command))) - {"--help"}
    missing = sorted(o for o in options if f"`{o}`" not in page)
    assert not missing, f"docs/cli.md does not document {command} {missing}"


def test_policy_reference_states_each_gateway_default() -> None:
    page = text(DOCS / "policy.md")
    section = page[page.index("## gateway"):page.index("## backends")]
    rows = {m.group(1): m.group(2).strip().strip("`")
            for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE)}
    # A nested settings field (edge) has a row of its own per field: edge.<name>.
    nested = {f"{f.name}.{g.name}": g.default for f in dataclasses.fields(Gateway)
              if f.default is dataclasses.MISSING
              for g in dataclasses.fields(f.default_factory())}  # type: ignore[misc]
    rows.update({m.group(1): m.group(2).strip().strip("`")
                 for m in re.finditer(r"^\| `(\w+\.\w+)` \| ([^|]+) \|", section, re.MULTILINE)})
    plain = {f.name: f.default for f in dataclasses.fields(Gateway)
             if f.default is not dataclasses.MISSING}
    defaults = {**plain, **nested}
    wrong = [f"{name}: docs/policy.md says {rows.get(name)!r}, default is {_shown(default)!r}"
             for name, default in defaults.items() if rows.get(name) != _shown(default)]
    assert not wrong, "; ".join(wrong)


def test_pages_say_what_a_rule_protects_not_a_tracker_number() -> None:
    # A reader of the repository cannot resolve "issue 10"; say what it means instead.
    cited = {}
    for page in [README, ROOT / "CHANGELOG.md", *PAGES]:
        for m in re.finditer(r"\bissues? #?\d+", text(page), re.IGNORECASE):
            cited.setdefault(page.relative_to(ROOT).as_posix(), m.group(0))
    assert not cited, f"tracker numbers in the docs: {cited}"


def test_every_refusal_reason_is_on_the_errors_page_with_its_status() -> None:
    """docs/errors.md's table names each reason once, on a row with the status it is answered with."""
    rows = [line.split("|") for line in text(ROOT / "docs" / "errors.md").splitlines()
            if re.match(r"^\| \d{3} \|", line)]
    documented = {reason: int(cells[1]) for cells in rows for reason in re.findall(r"`(\w+)`", cells[2])}
    for reason in Reason:
        if reason is Reason.CLIENT_GONE:
            continue  # never answered: the client is gone
        assert documented.get(reason) == reason.status, (reason, documented.get(reason))
    assert set(documented) <= {str(r) for r in Reason}, set(documented) - {str(r) for r in Reason}
