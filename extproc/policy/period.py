"""Calendar periods in a time zone: which period an instant falls in, and where it ends.

A budget counts per calendar period (a day, an ISO week from Monday, a month; an hour
or a minute for trying a budget out), not over a sliding window, in the time zone the
policy states. Pure: the instant (``wall``, epoch seconds) and the zone (a ``tzinfo``)
are passed in; nothing here reads a clock.

A period boundary is the first instant whose local time is at or past the boundary's
label (midnight of a date, the top of an hour). That one rule covers daylight saving:
a day may last 23 or 25 hours; a midnight that the clock skips (a zone that springs
forward at 00:00) starts its day when the clock resumes; a repeated local hour (the
clock falls back) belongs to the period its first pass was in, so periods never
overlap and never leave a gap, and a date a zone skipped entirely (Samoa's
2011-12-30) is a period no instant falls in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

__all__ = ["PERIODS", "Span", "span_at"]

PERIODS = ("minute", "hour", "day", "week", "month")


@dataclass(frozen=True, slots=True)
class Span:
    """One calendar period: ``[start, end)`` in epoch seconds, and its local label."""

    kind: str
    start: float
    end: float
    label: str  # the local start, e.g. "2025-03-09", "2025-W10", "2025-03", "2025-03-09T14:00"

    def contains(self, wall: float) -> bool:
        return self.start <= wall < self.end

    def remaining_s(self, wall: float) -> float:
        return max(0.0, self.end - wall)


def _local(wall: float, zone: tzinfo) -> datetime:
    """The zone's naive local time at ``wall``, to the second below it: offsets are whole
    seconds, and ``fromtimestamp`` rounds to the microsecond, which can cross a boundary."""
    return datetime.fromtimestamp(math.floor(wall), zone).replace(tzinfo=None)


def _floor(local: datetime, kind: str) -> datetime:
    if kind == "minute":
        return local.replace(second=0, microsecond=0)
    if kind == "hour":
        return local.replace(minute=0, second=0, microsecond=0)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "day":
        return day
    if kind == "week":
        return day - timedelta(days=day.weekday())
    if kind == "month":
        return day.replace(day=1)
    raise ValueError(f"unknown period {kind!r} (known: {', '.join(PERIODS)})")


def _next(label: datetime, kind: str) -> datetime:
    if kind == "minute":
        return label + timedelta(minutes=1)
    if kind == "hour":
        return label + timedelta(hours=1)
    if kind == "day":
        return label + timedelta(days=1)
    if kind == "week":
        return label + timedelta(days=7)
    return label.replace(year=label.year + 1, month=1) if label.month == 12 else label.replace(month=label.month + 1)


def _epoch(local: datetime, zone: tzinfo, fold: int) -> float:
    return local.replace(tzinfo=zone, fold=fold).timestamp()


def boundary(label: datetime, zone: tzinfo) -> float:
    """The first instant whose local time is at or after ``label``.

    An ordinary label is one instant; a repeated one (fold) starts at its first pass
    (fold 0, the earlier instant). A label inside a gap the clock jumps over starts
    where the clock lands past it: between the two readings of the label (its
    offset before and after the jump), found by bisection on whole seconds (zones
    change offset on whole seconds).
    """
    early, late = sorted((_epoch(label, zone, 0), _epoch(label, zone, 1)))
    if _local(early, zone) >= label:
        return early
    lo, hi = int(early), int(late) + 1  # local(lo) < label <= local(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _local(mid, zone) >= label:
            hi = mid
        else:
            lo = mid
    return float(hi)


def _name(label: datetime, kind: str) -> str:
    if kind == "minute":
        return label.strftime("%Y-%m-%dT%H:%M")
    if kind == "hour":
        return label.strftime("%Y-%m-%dT%H:00")
    if kind == "day":
        return label.strftime("%Y-%m-%d")
    if kind == "week":
        year, week, _ = label.isocalendar()
        return f"{year}-W{week:02d}"
    return label.strftime("%Y-%m")


# A period's bounds cost two zone conversions and a few datetimes (~10 us); a request
# asks for the one it falls in, which is the same as the last request's almost always.
_CACHE_SIZE = 4096
_cache: dict[tuple[str, str], Span] = {}


def span_at(kind: str, zone: tzinfo, wall: float) -> Span:
    """The period of ``kind`` in ``zone`` that ``wall`` falls in."""
    key = (kind, str(zone))
    hit = _cache.get(key)
    if hit is not None and hit.start <= wall < hit.end:
        return hit
    span = _compute(kind, zone, wall)
    if len(_cache) >= _CACHE_SIZE:
        _cache.clear()
    _cache[key] = span
    return span


def _compute(kind: str, zone: tzinfo, wall: float) -> Span:
    label = _floor(_local(wall, zone), kind)
    start = boundary(label, zone)
    nxt = _next(label, kind)
    end = boundary(nxt, zone)
    # After the clock fell back, the local time reads earlier than a boundary already
    # passed: the period is the last one whose boundary is at or before ``wall``.
    while end <= wall:
        label, start = nxt, end
        nxt = _next(label, kind)
        end = boundary(nxt, zone)
    return Span(kind, start, end, _name(label, kind))
