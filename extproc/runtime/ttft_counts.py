"""Cumulative TTFT bucket counts per backend and tier, for the console's percentiles.

The console shows a 15-minute TTFT p50 / p99 per tier. A replica cannot know the
console's window, and percentiles of several replicas cannot be averaged, so each
status report carries these cumulative counts (the console stores their increments
per report and adds them up over any window, across replicas, as Prometheus'
``histogram_quantile`` does). The buckets are finer than ``sluice_ttft_seconds``'
around the SLOs people set (0.5-3 s). Observed with the same TTFT (admission to first
byte) as ``sluice_ttft_seconds`` and the tiers' ``ttft_p99_ms``.
"""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds in ms; one more count for "above the last bound".
BOUNDS_MS = (25, 50, 75, 100, 150, 200, 300, 400, 500, 750, 1000, 1250, 1500, 1750, 2000, 2500, 3000,
             4000, 5000, 7500, 10000, 15000, 20000, 30000, 60000)


class TtftCounts:
    def __init__(self) -> None:
        self._counts: dict[str, dict[str, list[int]]] = {}

    def observe(self, backend: str, tier: str, seconds: float) -> None:
        per_tier = self._counts.setdefault(backend, {})
        counts = per_tier.get(tier)
        if counts is None:
            counts = per_tier[tier] = [0] * (len(BOUNDS_MS) + 1)
        counts[bisect_left(BOUNDS_MS, seconds * 1000.0)] += 1

    def report(self, backend: str) -> dict[str, list[int]]:
        """tier -> cumulative count per bucket (a copy)."""
        return {tier: list(c) for tier, c in self._counts.get(backend, {}).items()}
