"""Ordinary text for the tokenizer's tests and benchmark: the repository's own prose and code.

English is the README followed by every page under docs/ (sorted), so the corpus stays
hundreds of KiB of real prose after the README became a short front door; code is every
module under extproc/.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def english() -> str:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in pages)


def code() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "extproc").rglob("*.py")))
