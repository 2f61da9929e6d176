"""The README's two commands do all the set-up: the Makefile installs every Debian
package the tests and the demo need, and says clearly when it cannot."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "system_packages.sh"


def _make_var(name: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{name}\s*:=(.*)$", text, re.M)
    assert m, f"{name} is not set in the Makefile"
    return m.group(1).split()


def _prerequisites(target: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{target}:(.*)$", text, re.M)
    assert m, f"no {target} target"
    return m.group(1).split()


def test_test_target_installs_the_system_packages_the_tests_use() -> None:
    used = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        if "/usr/bin/chromium" in text:
            used.add("chromium")
        if "redis-server" in text and path.name != "test_setup.py":
            used.add("redis-server")
    assert "chromium" in used  # the browser test is still there
    assert used <= set(_make_var("TEST_SYSTEM_PACKAGES"))
    assert "system-packages-test" in _prerequisites("test")


def test_ci_runs_only_the_readme_test_command() -> None:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert "make test" in lines
    assert not any("apt-get" in ln for ln in lines), "CI must not install what make test does not"


def _fake_bin(tmp_path: Path, installed: set[str], with_apt: bool) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dpkg = bin_dir / "dpkg-query"
    cases = "\n".join(f'  {p}) echo "install ok installed"; exit 0;;' for p in installed)
    dpkg.write_text(f'#!/bin/sh\ncase "$3" in\n{cases}\n  *) exit 1;;\nesac\n')
    dpkg.chmod(0o755)
    if with_apt:
        apt = bin_dir / "apt-get"
        apt.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/apt.log\n')
        apt.chmod(0o755)
    for tool in ("sh", "grep", "id", "echo", "cat"):
        real = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if real and real.startswith("/"):
            (bin_dir / tool).symlink_to(real)
    return {**os.environ, "PATH": str(bin_dir)}


def test_nothing_runs_when_every_package_is_present(tmp_path: Path) -> None:
    env = _fake_bin(tmp_path, {"chromium", "fonts-dejavu-core"}, with_apt=True)
    r = subprocess.run(["sh", str(SCRIPT), "chromium", "fonts-dejavu-core"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "apt.log").exists()
    assert r.stdout == ""


@pytest.mark.skipif(os.getuid() != 0, reason="the install path runs apt-get as root")
def test_missing_packages_are_installed_after_an_update(tmp_path: Path) -> None:
    env = _fake_bin(tmp_path, {"fonts-dejavu-core"}, with_apt=True)
    r = subprocess.run(["sh", str(SCRIPT), "chromium", "fonts-dejavu-core"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0].startswith("update")
    assert calls[1].split()[-1] == "chromium" and "fonts-dejavu-core" not in calls[1]


def test_without_apt_it_fails_saying_what_to_install(tmp_path: Path) -> None:
    env = _fake_bin(tmp_path, set(), with_apt=False)
    r = subprocess.run(["sh", str(SCRIPT), "chromium"], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "apt-get is not available" in r.stderr and "chromium" in r.stderr
