"""Parsing the budget and price settings: a tier's or tenant's ``budget``, a model's
``price``, a backend's ``gpu_hour_cost``.

Money in the policy is decimal (``cost: 2.50``, prices per million tokens); it is held
as integer nanos (``extproc.policy.budget``), and a value that nanos cannot hold exactly
is refused rather than rounded. The time zone is an IANA name, resolved once here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from extproc.policy.budget import ALERTS, NANOS, Budget, Price
from extproc.policy.period import PERIODS
from extproc.policy.reader import Path, Reader

__all__ = ["BUDGET_FIELDS", "PRICE_FIELDS", "read_budget", "read_currency", "read_money", "read_price"]

BUDGET_FIELDS = ("period", "time_zone", "tokens", "cost", "alerts")
PRICE_FIELDS = ("input", "output", "cached_input")
NO_BUDGET = Budget()  # a tenant's ``budget: false``: none, whatever its tier has


def read_money(r: Reader, value: Any, path: Path, per: int = 1) -> int | None:
    """A decimal amount (``per`` of them make one priced unit) as integer nanos, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        r.fail(path, f"expected a decimal amount, got {type(value).__name__}")
        return None
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        r.fail(path, f"expected a decimal amount, got {value!r}")
        return None
    if not d.is_finite() or d < 0:
        r.fail(path, f"must be a finite amount >= 0, got {value!r}")
        return None
    nanos = d * NANOS / per
    if nanos != nanos.to_integral_value():
        r.fail(path, f"{value!r} is finer than Sluice counts money (1e-9 of the currency"
                     f"{' per token' if per > 1 else ''})")
        return None
    return int(nanos)


def read_price(r: Reader, doc: Any, path: Path) -> Price | None:
    """``price: {input, output, cached_input}``, each per million tokens."""
    if doc is None:
        return None
    m = r.mapping(doc, path, PRICE_FIELDS)
    per = 1_000_000
    values = {k: read_money(r, m[k], (*path, k), per) for k in PRICE_FIELDS if m.get(k) is not None}
    return Price(input=values.get("input") or 0, output=values.get("output") or 0,
                 cached_input=values.get("cached_input"))


def _zone(r: Reader, name: Any, path: Path) -> ZoneInfo | None:
    if not isinstance(name, str):
        r.fail(path, f"expected an IANA time zone name (e.g. UTC, Europe/Berlin), got {type(name).__name__}")
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        r.fail(path, f"unknown time zone {name!r} (an IANA name, e.g. UTC, America/New_York)")
        return None


def _alerts(r: Reader, raw: Any, path: Path) -> tuple[float, ...]:
    if raw is None:
        return ALERTS
    if not isinstance(raw, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in raw):
        r.fail(path, "expected a list of fractions of the budget, e.g. [0.5, 0.8, 1.0]")
        return ALERTS
    if not all(0 < x <= 1 for x in raw):
        r.fail(path, "every alert is a fraction of the budget in (0, 1]")
        return ALERTS
    return tuple(sorted({float(x) for x in raw}))


def read_budget(r: Reader, doc: Any, path: Path, *, may_disable: bool) -> Budget | None:
    """A ``budget`` mapping; None when absent. ``false`` (a tenant only: ``may_disable``)
    is no budget even where the tier has one."""
    if doc is None:
        return None
    if doc is False and may_disable:
        return NO_BUDGET
    m: Mapping[str, Any] = r.mapping(doc, path, BUDGET_FIELDS)
    if not m:
        return None
    period = r.get(m, path, "period", str, "month", choices=PERIODS)
    zone = _zone(r, m.get("time_zone", "UTC"), (*path, "time_zone"))
    tokens = r.get(m, path, "tokens", int, None, minimum=0)
    cost = read_money(r, m["cost"], (*path, "cost")) if m.get("cost") is not None else None
    if tokens is None and cost is None and "tokens" not in m and "cost" not in m:
        r.fail(path, "a budget limits tokens, cost, or both")
    budget = Budget(period=period or "month", tokens=tokens, cost_nanos=cost,
                    alerts=_alerts(r, m.get("alerts"), (*path, "alerts")))
    return budget if zone is None else Budget(budget.period, zone, budget.tokens, budget.cost_nanos, budget.alerts)


def read_currency(r: Reader, m: Mapping[str, Any], path: Path) -> str:
    """The gateway's ``currency``: a three-letter code, upper-cased (a label; never converted)."""
    v = r.get(m, path, "currency", str, "USD")
    if not re.fullmatch(r"[A-Za-z]{3}", v or ""):
        r.fail((*path, "currency"), f"expected a three-letter currency code (USD, EUR, ...), got {v!r}")
        return "USD"
    return str(v).upper()
