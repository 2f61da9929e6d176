"""A tenant's last 30 days as a server-rendered SVG bar chart, with its budget line.

One bar per local day (in the budget's time zone, UTC without one). A daily budget is
a horizontal line at its limit; a weekly or monthly one is drawn against the running
total since its period began (a line that climbs and drops back at each new period),
so both say at a glance how close each period came. Presentation attributes only (no
``style``: the console's CSP), like ``console.sparkline``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from markupsafe import Markup, escape

from extproc.policy.schema import Budget

DAYS = 30


@dataclass(frozen=True)
class Day:
    label: str  # local date, YYYY-MM-DD
    value: float  # the day's use in the chart's unit (tokens, or currency units)
    running: float  # since the budget's period began (the day itself included)


def days(hours: Sequence[dict[str, Any]], now: float, zone: tzinfo, budget: Budget | None,
         unit: str) -> list[Day]:
    """The last ``DAYS`` local days, oldest first, from hourly rows (``console.usage.hourly``).

    ``unit``: ``cost`` (spend, in currency units) or ``tokens``. An hour counts on the
    local day it starts on."""
    today = datetime.fromtimestamp(now, zone).date()
    labels = [(today - timedelta(days=DAYS - 1 - i)).isoformat() for i in range(DAYS)]
    sums = dict.fromkeys(labels, 0.0)
    for h in hours:
        label = datetime.fromtimestamp(h["hour"], zone).date().isoformat()
        if label in sums:
            sums[label] += value_of(h, unit)
    out, running, period = [], 0.0, None
    for label in labels:
        start = datetime.fromisoformat(label).replace(tzinfo=zone).timestamp()
        p = budget.key(budget.span(start + 1)) if budget is not None else None
        if p != period:
            running, period = 0.0, p
        running += sums[label]
        out.append(Day(label, sums[label], running))
    return out


def value_of(row: dict[str, Any], unit: str) -> float:
    if unit == "cost":
        return (row.get("spend_nanos") or 0) / 1e9
    return float((row.get("prompt_tokens") or 0) + (row.get("completion_tokens") or 0))


def svg(series: Sequence[Day], *, limit: float | None, cumulative: bool, unit_label: str,
        width: int = 720, height: int = 180) -> Markup:
    """Bars per day; with a ``limit``, the budget line (and for ``cumulative`` budgets the
    running total it is measured against)."""
    pad_l, pad_b = 56, 18
    plot_w, plot_h = width - pad_l - 4, height - pad_b - 6
    top = max([1e-9, *(d.value for d in series), *((d.running for d in series) if cumulative else ()),
               *((limit * 1.15,) if limit else ())])
    bar_w = plot_w / max(len(series), 1)

    def y(v: float) -> float:
        return round(6 + plot_h - min(max(v / top, 0.0), 1.0) * plot_h, 1)

    label = f"Use per day, last {len(series)} days ({unit_label})"
    parts = [f'<svg class="usage-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">',
             f"<title>{escape(label)}</title>",
             f'<rect x="{pad_l}" y="6" width="{plot_w}" height="{plot_h}" fill="#f6f7f9"/>',
             f'<text x="{pad_l - 4}" y="12" text-anchor="end" font-size="10" fill="#667085">{_num(top)}</text>',
             f'<text x="{pad_l - 4}" y="{6 + plot_h}" text-anchor="end" font-size="10" fill="#667085">0</text>']
    for i, d in enumerate(series):
        x = round(pad_l + i * bar_w + 1, 1)
        h = round(6 + plot_h - y(d.value), 1)
        parts.append(f'<rect class="bar" data-day="{d.label}" data-value="{d.value:g}" x="{x}" y="{y(d.value)}" '
                     f'width="{round(max(bar_w - 2, 1), 1)}" height="{h}" fill="#2563eb">'
                     f"<title>{d.label}: {_num(d.value)} {escape(unit_label)}</title></rect>")
        if i % 7 == len(series) % 7:
            parts.append(f'<text x="{x}" y="{height - 4}" font-size="9" fill="#667085">{d.label[5:]}</text>')
    if cumulative and series:
        pts = " ".join(f"{round(pad_l + (i + 0.5) * bar_w, 1)},{y(d.running)}" for i, d in enumerate(series))
        parts.append(f'<polyline class="running" points="{pts}" fill="none" stroke="#1e3a8a" stroke-width="1.2"/>')
    if limit:
        parts.append(f'<line class="budget-line" data-limit="{limit:g}" x1="{pad_l}" x2="{pad_l + plot_w}" '
                     f'y1="{y(limit)}" y2="{y(limit)}" stroke="#d9534f" stroke-width="1.4" stroke-dasharray="5 3">'
                     f"<title>budget: {_num(limit)} {escape(unit_label)}</title></line>")
    parts.append("</svg>")
    return Markup("".join(parts))


def _num(v: float) -> str:
    if v >= 100 or float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:,.4f}".rstrip("0").rstrip(".")


def zone_of(budget: Budget | None) -> tzinfo:
    return budget.zone if budget is not None else UTC
