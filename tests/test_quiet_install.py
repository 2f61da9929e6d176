"""`make install` prints nothing a newcomer cannot act on: no setuptools deprecation (the
license is an SPDX string), no editable-install notice (filtered by the one message the
Makefile names), and the real install command is the Makefile's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_var(name: str) -> str:
    m = re.search(rf"^{name}\s*:=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"{name} is not set in the Makefile"
    return m.group(1).strip()


def test_the_makefile_installs_editable_with_the_notice_filtered() -> None:
    recipe = (
        (ROOT / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    )
    assert "PYTHONWARNINGS=\"$(PIP_WARNINGS)\" $(PY) -m pip install -q -e '.[test]'" in recipe
    assert make_var("PIP_WARNINGS") == "ignore:Editable installation"


def test_an_editable_install_prints_nothing(tmp_path: Path) -> None:
    # The venv's setuptools (the test extra's) builds it, so no index is needed; the
    # project is installed into a scratch prefix, never over the running venv
    # (--ignore-installed: without it pip first uninstalls the venv's own editable install).
    env = {**os.environ, "PYTHONWARNINGS": make_var("PIP_WARNINGS")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--ignore-installed",
            "--disable-pip-version-check",
            "-e",
            str(ROOT),
            "--prefix",
            str(tmp_path / "prefix"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == "", done.stdout + done.stderr
    assert list((tmp_path / "prefix").rglob("__editable__.sluice-*.pth")), "nothing was installed"
    # The venv's own install is untouched: the project still imports from outside the tree.
    here = subprocess.run([sys.executable, "-c", "import extproc, console; print(extproc.__file__)"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert here.returncode == 0 and str(ROOT) in here.stdout, here.stderr


def test_the_license_is_an_spdx_expression() -> None:
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert any(
        re.match(r"setuptools>=(\d+)", r) and int(re.match(r"setuptools>=(\d+)", r)[1]) >= 77
        for r in doc["build-system"]["requires"]
    )
