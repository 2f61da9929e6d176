"""A burst out of the conversation trace: its densest window, replayed time-compressed.

``bench.trace`` stretches consecutive arrivals onto phases of a chosen load; the pool
benchmark instead replays the trace's own busiest stretch, its gaps divided by a
compression factor (3: arrivals at three times the trace's rate there), split into the
premium and free tiers. Pure; the rows come from ``bench.trace.load_trace``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from bench.trace import Mix, Request, TraceRow, chat_request


def densest_window(rows: Sequence[TraceRow], seconds: float) -> int:
    """Index of the first row of the ``seconds``-long stretch (trace time) with the most
    arrivals; the earliest such stretch on ties. ``rows`` sorted by time."""
    if not rows:
        raise ValueError("no rows")
    if seconds <= 0:
        raise ValueError("seconds must be > 0")
    best, best_at, j = 0, 0, 0
    for i in range(len(rows)):  # i: the window's first row, j: one past its last
        while j < len(rows) and rows[j].t < rows[i].t + seconds:
            j += 1
        if j - i > best:
            best, best_at = j - i, i
    return best_at


def burst_schedule(rows: Sequence[TraceRow], start: int, seconds: float, compress: float,
                   mix: Mix, phase: str = "burst", seed: int = 7) -> list[Request]:
    """The arrivals of ``rows`` in [rows[start].t, + ``seconds``), ``at`` = trace offset /
    ``compress`` (so they span ``seconds / compress`` of wall time), chat requests dealt to
    premium with probability ``mix.premium_share``, else free. Seeded: every configuration
    sees the same requests."""
    if compress <= 0:
        raise ValueError("compress must be > 0")
    rng = random.Random(seed)
    t0 = rows[start].t
    out: list[Request] = []
    for row in rows[start:]:
        if row.t >= t0 + seconds:
            break
        tier = "premium" if rng.random() < mix.premium_share else "free"
        req = chat_request(len(out), (row.t - t0) / compress, phase, row, tier, mix)
        out.append(req)
    return out


def ratio(value: float | None, base: float | None) -> float:
    """``value / base``; nan when either is missing, nan or the base is 0."""
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base == 0:
        return math.nan
    return value / base


def mean_between(samples: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Mean of the (time, value) samples with a <= time < b; nan if none."""
    xs = [v for t, v in samples if a <= t < b]
    return sum(xs) / len(xs) if xs else math.nan
