"""The invariant every end-to-end test can hold Sluice to: what it charged each request
equals what the engine processed for it, within the bound of what the charge rests on
(the bounds and the pairing: bench/billing.py).

    billing = Billing.of(stack)        # marks now
    ... requests ...
    billing.check(expect={"reported": 3, "estimated": 1})

or the ``billing`` fixture (tests/e2e/conftest.py), which checks at the end of the test.
For a stack with several engines or extproc replicas, ``Billing([admin urls], [engine
urls]).mark()``. Engine records that name no tenant (Sluice's own probes, pass-through
paths) are not billable and are left out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.billing import SENT, Bounds, Pair, pair, problems, settled_since, work_since

__all__ = ["Billing", "Bounds", "Pair"]


@dataclass
class Billing:
    admin_urls: Sequence[str]  # each extproc replica's admin port
    sim_urls: Sequence[str]  # each engine
    bounds: Bounds = field(default_factory=Bounds)
    _settle_marks: dict[str, int] = field(default_factory=dict)
    _work_marks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, stack: Any, **bounds: Any) -> Billing:
        """For the harness's one-engine Stack (or anything with ``admin_url`` and ``sim_url``)."""
        return cls([stack.admin_url], [stack.sim_url], Bounds(**bounds)).mark()

    def mark(self) -> Billing:
        """From now on: only requests settled and processed after this count."""
        self._settle_marks = {u: settled_since(u, 1 << 62)[0] for u in self.admin_urls}
        self._work_marks = {u: work_since(u, 1 << 62)[0] for u in self.sim_urls}
        return self

    def _read(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        settled = [
            r for u in self.admin_urls for r in settled_since(u, self._settle_marks.get(u, 0))[1]
        ]
        work = [r for u in self.sim_urls for r in work_since(u, self._work_marks.get(u, 0))[1]]
        return settled, work

    def pairs(self, timeout: float = 5.0) -> list[Pair]:
        """Every request either side recorded since the mark, once both sides agree it ended
        (or ``timeout`` passed): a forwarded request's engine record, and a settle record
        for every billable engine record."""
        deadline = time.monotonic() + timeout
        while True:
            pairs = pair(*self._read())
            waiting = [
                p for p in pairs if (p.settled is None or (p.basis in SENT and p.work is None))
            ]
            if not waiting or time.monotonic() > deadline:
                return pairs
            time.sleep(0.05)

    def check(self, timeout: float = 5.0, expect: dict[str, int] | None = None) -> list[Pair]:
        """Assert the invariant for everything since the mark; ``expect``: how many requests of
        each basis the test made (so a test cannot pass by making none). Returns the pairs."""
        pairs = self.pairs(timeout)
        bad = problems(pairs, self.bounds)
        assert not bad, "charged != processed:\n" + "\n".join(bad)
        if expect is not None:
            got = {b: sum(1 for p in pairs if p.basis == b) for b in expect}
            assert got == expect, f"bases {got}, expected {expect}:\n" + "\n".join(map(str, pairs))
        return pairs

    @staticmethod
    def totals(pairs: Sequence[Pair]) -> tuple[int, int]:
        """(charged, processed) over ``pairs``."""
        return sum(p.charged for p in pairs), sum(p.processed for p in pairs)
