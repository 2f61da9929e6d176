"""Read the policy files from git: the console's base layer.

Same merge rules as the data plane's loader: ``backends`` and ``tenants`` lists
concatenate across files, ``tiers`` mappings merge (a tier defined twice is an
error), ``gateway`` appears in one file. Validation is the schema's job; this
module only turns files into one plain document and remembers which file held what,
so the export can show a diff per file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The data plane's file set and its change check: the console reads what extproc reads.
from extproc.policyfile import policy_files


class BaseError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Base:
    files: dict[str, str]  # file name -> text, in load order
    doc: dict[str, Any]
    sha: str

    def file_data(self, name: str) -> dict[str, Any]:
        data = yaml.safe_load(self.files[name])
        return data if isinstance(data, dict) else {}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def merge(parts: list[tuple[str, Any]]) -> dict[str, Any]:
    """Merge parsed files into one document; raise ``BaseError`` on structural clashes."""
    doc: dict[str, Any] = {}
    problems: list[str] = []
    for name, data in parts:
        if data is None:
            continue
        if not isinstance(data, dict):
            problems.append(f"{name}: expected a mapping of sections")
            continue
        for section, value in data.items():
            if section not in doc:
                doc[section] = value
            elif isinstance(value, list) and isinstance(doc[section], list):
                doc[section] = [*doc[section], *value]
            elif isinstance(value, dict) and isinstance(doc[section], dict) and section != "gateway":
                for key in value:
                    if key in doc[section]:
                        problems.append(f"{name}: {section}.{key}: defined twice")
                doc[section] = {**doc[section], **value}
            else:
                problems.append(f"{name}: {section}: defined in more than one file")
    if problems:
        raise BaseError(problems)
    return doc


def from_texts(files: dict[str, str]) -> Base:
    parts = []
    problems = []
    for name, text in files.items():
        try:
            parts.append((name, yaml.safe_load(text)))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark else ""
            problems.append(f"{name}{line}: not valid YAML: {getattr(exc, 'problem', exc)}")
    if problems:
        raise BaseError(problems)
    doc = merge(parts)
    return Base(files=dict(files), doc=doc, sha=hashlib.sha256(canonical_json(doc).encode()).hexdigest())


def read_dir(directory: Path) -> Base:
    files = policy_files(directory)
    if not files:
        raise BaseError([f"{directory}: no *.yaml policy files found"])
    return from_texts({f.name: f.read_text(encoding="utf-8") for f in files})
