"""Operator input checked by the data plane's own schema, mapped back to form fields.

``build_policy`` is the single judge of what a valid policy is: a form is valid when
the effective document with the edit applied builds. Its problems carry document
paths, which are turned into "next to this field" messages here.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from extproc.policy import schema

# The lead may teach the schema about manual breakers; until then they are the
# console's own section and are checked here instead.
SCHEMA_KNOWS_BREAKERS = "breakers" in schema.SECTIONS
POLICY_SECTIONS = ("gateway", "backends", "tiers", "tenants")


@dataclass(frozen=True)
class PathProblem:
    path: tuple[str | int, ...]
    message: str


def for_schema(doc: dict[str, Any]) -> dict[str, Any]:
    if SCHEMA_KNOWS_BREAKERS:
        return doc
    return {k: v for k, v in doc.items() if k != "breakers"}


def problems(doc: dict[str, Any]) -> list[PathProblem]:
    """Every problem the schema finds in ``doc``, with its document path."""
    try:
        build(doc)
    except schema.PolicyError as exc:
        return [_path_problem(p) for p in exc.problems]
    return []


def build(doc: dict[str, Any]) -> schema.Policy:
    # The schema may keep references into the document; hand it a private copy.
    return schema.build_policy(copy.deepcopy(for_schema(doc)), lambda path: json.dumps(list(path)))


def _path_problem(p: schema.Problem) -> PathProblem:
    try:
        path = tuple(json.loads(p.where))
    except ValueError:
        path = ()
    # The message repeats the dotted path in front: "tenants[0].tier: unknown tier ..."
    _, sep, rest = p.message.partition(": ")
    return PathProblem(path, rest if sep else p.message)


def parse_number(raw: str | None, kind: str) -> tuple[int | float | None, str | None]:
    if kind == "int":
        return parse_int(raw)
    text = (raw or "").strip().replace("_", "")
    if not text:
        return None, None
    try:
        value = float(text)
    except ValueError:
        return None, f"expected a number, got {raw!r}"
    if not math.isfinite(value):
        return None, f"expected a finite number, got {raw!r}"
    return (int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value), None


def parse_int(raw: str | None) -> tuple[int | None, str | None]:
    """A form's number: blank means "not set"; anything else must be a whole number."""
    text = (raw or "").strip().replace("_", "")
    if not text:
        return None, None
    try:
        return int(text), None
    except ValueError:
        return None, f"expected a whole number, got {raw!r}"


def field_errors(found: list[PathProblem], prefix: tuple[str | int, ...],
                 fields: tuple[str, ...], fallback: dict[tuple[str | int, ...], str] | None = None
                 ) -> dict[str, list[str]]:
    """Group problems by the form field they concern; the rest go under ``""``.

    ``prefix`` is the edited entity's path (``("tenants", 2)``); ``fallback`` maps
    other paths to a field (a backend's budget exceeded -> the tier's guaranteed slots).
    """
    out: dict[str, list[str]] = {}
    for p in found:
        name = ""
        rest = p.path[len(prefix):] if p.path[: len(prefix)] == prefix else ()
        for k in range(len(rest), 0, -1):  # the longest dotted field the path falls under
            if ".".join(map(str, rest[:k])) in fields:
                name = ".".join(map(str, rest[:k]))
                break
        if not name and fallback:
            for pattern, fld in fallback.items():
                if _matches(p.path, pattern):
                    name = fld
                    break
        out.setdefault(name, []).append(p.message)
    return out


def _matches(path: tuple[str | int, ...], pattern: tuple[str | int, ...]) -> bool:
    return len(path) == len(pattern) and all(q == "*" or q == s for s, q in zip(path, pattern, strict=True))
