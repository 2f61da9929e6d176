"""Bounds on what a replica may report: size, nesting and shape, checked before it is stored.

A report is small (a few KiB: some backends, the tenants a replica has seen). Anything far
outside that is refused with a 400 naming the limit, never parsed into a 500 (a deeply
nested document makes ``json.loads`` recurse) nor stored for every page to render.
The nesting depth is measured on the raw bytes, before parsing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.openai_api.body import DuplicateKey, unique_keys

MAX_BYTES = 256 * 1024
MAX_DEPTH = 12  # a report is about 5 deep: backends.<name>.slots.by_tier.<tier>
MAX_BACKENDS = 256
MAX_TENANTS = 2000
MAX_KEYS = 256  # entries of any other mapping or list (reasons, tiers, ...)
MAX_STRING = 256  # characters of any key or string value
# Lists that grow with the tenants rather than with a replica's structure: usage per
# tenant, model and hour (extproc.runtime.usage_history), budget periods per tenant.
WIDE_LISTS = {"usage.rows": 4 * MAX_TENANTS, "budgets.periods": MAX_TENANTS}

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class Violation:
    code: str  # report_too_large | report_too_deep | report_too_wide | report_string_too_long | ...
    message: str
    param: str | None = None


def nesting_depth(raw: bytes) -> int:
    """The deepest ``[``/``{`` nesting outside strings; linear, no recursion."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        if b in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class _NotJson(ValueError):
    pass


def _not_json(name: str) -> float:
    # Python reads NaN and Infinity, JSON has neither: a gauge of NaN would be stored and
    # shown as a number, and sort and sum as none.
    raise _NotJson(name)


def parse(raw: bytes) -> tuple[Any, Violation | None]:
    """The report as JSON, or why it is refused."""
    if len(raw) > MAX_BYTES:
        return None, Violation("report_too_large", f"a status report is at most {MAX_BYTES} bytes, got {len(raw)}")
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        return None, Violation("report_too_deep", f"a status report nests at most {MAX_DEPTH} levels, got {depth}")
    try:
        body = json.loads(raw, parse_constant=_not_json, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        return None, Violation("duplicate_key", f"a status report names the key {exc.key!r} more "
                               "than once in one object", exc.key[:MAX_STRING])
    except _NotJson as exc:
        return None, Violation("invalid_json",
                               f"{exc} is not a JSON value (a number must be finite)")
    except (ValueError, RecursionError):
        return None, Violation("invalid_json", "expected a JSON object")
    if not isinstance(body, dict):
        return None, Violation("invalid_json", "expected a JSON object")
    return body, check_shape(body)


def check_shape(body: Mapping[str, Any]) -> Violation | None:
    for section, limit in (("backends", MAX_BACKENDS), ("tenants", MAX_TENANTS)):
        value = body.get(section)
        if isinstance(value, Mapping | list) and len(value) > limit:
            return Violation("report_too_wide", f"a status report names at most {limit} {section}, got {len(value)}",
                             section)
    return _walk(body, "", top=True)


def _walk(value: Any, path: str, top: bool = False) -> Violation | None:
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            return Violation("report_string_too_long", f"strings in a status report are at most {MAX_STRING} "
                             f"characters, got {len(value)}", path or None)
        return None
    if isinstance(value, Mapping):
        if not top and len(value) > MAX_KEYS and path not in ("backends", "tenants"):
            return Violation("report_too_wide", f"a mapping in a status report has at most {MAX_KEYS} entries, "
                             f"got {len(value)}", path)
        for k, v in value.items():
            if len(k) > MAX_STRING:
                return Violation("report_string_too_long", f"keys in a status report are at most {MAX_STRING} "
                                 f"characters, got {len(k)}", path or None)
            found = _walk(v, f"{path}.{k}" if path else k)
            if found:
                return found
        return None
    if isinstance(value, list):
        if len(value) > WIDE_LISTS.get(path, MAX_KEYS):
            return Violation("report_too_wide", f"a list in a status report has at most {MAX_KEYS} items, "
                             f"got {len(value)}", path)
        for i, v in enumerate(value):
            found = _walk(v, f"{path}[{i}]")
            if found:
                return found
    return None
