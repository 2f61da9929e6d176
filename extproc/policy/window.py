"""A sliding window of sums in fixed buckets: constant memory at any request rate."""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Window"]


class Window:
    """Sums of a few values over the last ``span`` seconds, in ``n`` fixed buckets."""

    def __init__(self, span: float, n: int, width: int) -> None:
        self._bucket_s = span / n
        self._n = n
        self._buckets: deque[list[float]] = deque()  # [index, *values]
        self.sums = [0.0] * width

    def add(self, now: float, *values: float) -> None:
        self.prune(now)
        idx = math.floor(now / self._bucket_s)
        if not self._buckets or self._buckets[-1][0] != idx:
            self._buckets.append([idx] + [0.0] * len(self.sums))
        last = self._buckets[-1]
        for i, v in enumerate(values):
            last[i + 1] += v
            self.sums[i] += v

    def prune(self, now: float) -> list[float]:
        oldest = math.floor(now / self._bucket_s) - self._n + 1
        while self._buckets and self._buckets[0][0] < oldest:
            gone = self._buckets.popleft()
            for i in range(len(self.sums)):
                self.sums[i] -= gone[i + 1]
        return self.sums

    def clear(self) -> None:
        self._buckets.clear()
        self.sums = [0.0] * len(self.sums)
