"""Walking a plain policy document while collecting every problem with its place."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

Path = tuple[str | int, ...]
Locator = Callable[[Path], str]
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class Problem:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class PolicyError(ValueError):
    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


def dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "<root>"


class Reader:
    """Walks the document collecting every problem, not just the first."""

    def __init__(self, locate: Locator):
        self.locate = locate
        self.problems: list[Problem] = []

    def fail(self, path: Path, message: str) -> None:
        self.problems.append(Problem(self.locate(path), f"{dotted(path)}: {message}"))

    def mapping(self, value: Any, path: Path, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in allowed:
                self.fail((*path, str(key)), f"unknown field (allowed: {', '.join(allowed)})")
        return value

    def get(self, m: Mapping[str, Any], path: Path, key: str, kind: type | tuple[type, ...],
            default: Any = ..., *, minimum: float | None = None, choices: tuple[Any, ...] = ()) -> Any:
        p = (*path, key)
        if key not in m or m[key] is None:
            if default is ...:
                self.fail(p, "required field is missing")
                return None
            return default
        v = m[key]
        # bool is an int in Python; a policy saying `tpm: true` is a mistake.
        if isinstance(v, bool) and kind is not bool:
            self.fail(p, f"expected {getattr(kind, '__name__', kind)}, got a boolean")
            return None if default is ... else default
        if not isinstance(v, kind):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(p, f"expected {want}, got {type(v).__name__}")
            return None if default is ... else default
        if minimum is not None and v < minimum:
            self.fail(p, f"must be >= {minimum}, got {v}")
        if choices and v not in choices:
            self.fail(p, f"must be one of {', '.join(map(str, choices))}, got {v!r}")
        return v

    def name(self, m: Mapping[str, Any], path: Path, key: str = "name") -> str | None:
        v = self.get(m, path, key, str)
        if v is not None and not NAME.match(v):
            self.fail((*path, key), f"{v!r} is not a valid name (lowercase letters, digits, _ . -)")
        return v


def read_flat(r: Reader, doc: Any, path: Path, cls: type) -> Any:
    """Read a flat settings mapping into dataclass ``cls``, typed by its defaults.

    Every field must have a default; floats accept ints; tuples are read from lists.
    """
    if doc is None:
        return cls()
    m = r.mapping(doc, path, tuple(f.name for f in fields(cls)))
    values: dict[str, Any] = {}
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if f.name not in m:
            continue
        if isinstance(default, bool):
            v = r.get(m, path, f.name, bool, default)
        elif isinstance(default, float) or default is None and "float" in str(f.type):
            v = r.get(m, path, f.name, (int, float), default, minimum=0)
            v = float(v) if v is not None else None
        elif isinstance(default, int):
            v = r.get(m, path, f.name, int, default, minimum=0)
        elif isinstance(default, tuple):
            raw = r.get(m, path, f.name, list, list(default))
            v = tuple(raw)
        else:
            v = r.get(m, path, f.name, str, default)
        values[f.name] = v
    try:
        return cls(**values)
    except ValueError as exc:
        r.fail(path, str(exc))
        return cls()
