"""Pure arithmetic over benchmark results: percentiles, goodput, the TPM window contract."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.loadgen import Result


def pct(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))
    return xs[k]


def tokens_between(results: Iterable[Result], a: float, b: float, only_ok: bool = True) -> float:
    """Completion tokens delivered in [a, b), each response's spread evenly over its streaming."""
    total = 0.0
    for r in results:
        if (only_ok and not r.ok) or not r.tokens or r.first is None or r.end is None:
            continue
        lo, hi = r.first, max(r.first, r.end)
        if hi <= lo:
            total += r.tokens if a <= hi < b else 0
            continue
        total += r.tokens * max(0.0, min(hi, b) - max(lo, a)) / (hi - lo)
    return total


@dataclass(frozen=True)
class TierStats:
    sent: int
    ok: int
    rejected_429: int
    rejected_503: int
    other_errors: int  # other statuses, cut streams, transport errors
    gave_up: int  # client timeouts: no first token in time, or too slow overall
    unfinished: int  # still waiting or streaming when the run ended
    degraded: int
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    tokens: int  # completion tokens in successful responses


def open_streams(results: Iterable[Result], t: float) -> int:
    """Requests the gateway had let through (200 headers) and not yet finished at ``t``."""
    return sum(1 for r in results if r.status == 200 and r.head is not None and r.head <= t
               and (r.end is None or t < r.end))


def tier_stats(results: Sequence[Result]) -> TierStats:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    s429 = sum(1 for r in results if r.status == 429)
    s503 = sum(1 for r in results if r.status == 503)
    gave = sum(1 for r in results if r.gave_up in ("ttft", "total") and r.status in (0, 200))
    unfinished = sum(1 for r in results if r.gave_up == "run_end" and r.status in (0, 200))
    other = len(results) - len(ok) - s429 - s503 - gave - unfinished
    return TierStats(len(results), len(ok), s429, s503, other, gave, unfinished,
                     sum(1 for r in results if r.degraded), pct(ttfts, .5), pct(ttfts, .99),
                     pct(e2es, .5), pct(e2es, .99), sum(r.tokens for r in ok))


# ---- the TPM contract -------------------------------------------------------------------
def max_window_ratio(events: Sequence[tuple[float, int]], burst: float, tpm: float,
                     max_window_s: float = 60.0) -> tuple[float, float, float]:
    """Worst window of a bucket's contract: consumed(W) <= burst + tpm * W / 60, W <= max_window_s.

    ``events`` are (time, tokens charged) pairs. Consumption is a step function, so the
    worst window starts and ends at events; every pair within ``max_window_s`` is tried.
    Returns (max consumed / bound, its window start, its length).
    """
    ev = sorted(events)
    prefix = [0]
    for _, n in ev:
        prefix.append(prefix[-1] + n)
    best, at, width = 0.0, math.nan, math.nan
    j0 = 0
    for j in range(len(ev)):
        while ev[j][0] - ev[j0][0] > max_window_s:
            j0 += 1
        for i in range(j0, j + 1):
            w = ev[j][0] - ev[i][0]
            ratio = (prefix[j + 1] - prefix[i]) / (burst + tpm * w / 60.0)
            if ratio > best:
                best, at, width = ratio, ev[i][0], w
    return best, at, width


def rate_per_minute(events: Sequence[tuple[float, int]], a: float, b: float) -> float:
    """Tokens charged in [a, b) scaled to 60 s."""
    if b <= a:
        return math.nan
    return sum(n for t, n in events if a <= t < b) * 60.0 / (b - a)


def spread_rate_per_minute(spans: Sequence[tuple[float, float, int]], a: float, b: float) -> float:
    """Tokens consumed in [a, b) scaled to 60 s, each response's tokens spread evenly over
    its life (sent .. end). Stamping a whole response at its end makes a short window's
    rate jump by one response's tokens as one end crosses the edge (~4.5 % of a 30 s
    window at 1,000 tokens/s and ~1,400 tokens a response); spreading removes that edge
    noise and not the rate, which the sum over a long run keeps."""
    if b <= a:
        return math.nan
    total = 0.0
    for start, end, n in spans:
        if end <= start:
            total += n if a <= end < b else 0
            continue
        overlap = min(end, b) - max(start, a)
        if overlap > 0:
            total += n * overlap / (end - start)
    return total * 60.0 / (b - a)
