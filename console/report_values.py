"""Reading a replica's report liberally: a missing or mistyped value is None (shown as "—"),
never an exception in a page."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def as_map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
