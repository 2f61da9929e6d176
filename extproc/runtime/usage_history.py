"""What each tenant used, per model and UTC hour, counted here and sent to the console.

Per (tenant, model, hour): requests that reached a backend and settled, prompt,
completion and cached prompt tokens as the engine reported them (or as Sluice counted
them when it did not), spend in nanos, and refusals by reason. The counts are
cumulative since this process started and go out with every status report for the
last ``KEEP_HOURS`` hours; the console stores the increments between two reports
(``console.usage``), so a lost report loses nothing and a restarted process (a new
``run``) starts again from zero. Hours are UTC: a console can show them in any zone.
"""

from __future__ import annotations

import secrets
from collections import Counter
from typing import Any

KEEP_HOURS = 3
NO_MODEL = "-"  # a refusal before the request named a model the policy serves


class _Hour:
    __slots__ = ("requests", "prompt", "completion", "cached", "nanos", "refusals")

    def __init__(self) -> None:
        self.requests = self.prompt = self.completion = self.cached = self.nanos = 0
        self.refusals: Counter[str] = Counter()


class UsageHistory:
    def __init__(self) -> None:
        self.run = secrets.token_hex(6)  # this process's counts: the console diffs within one run
        self._hours: dict[tuple[str, str, int], _Hour] = {}

    def _at(self, tenant: str, model: str, wall: float) -> _Hour:
        key = (tenant, model, int(wall // 3600) * 3600)
        h = self._hours.get(key)
        if h is None:
            h = self._hours[key] = _Hour()
            self._forget_before(key[2] - (KEEP_HOURS - 1) * 3600)
        return h

    def settled(self, tenant: str, model: str, prompt: int, completion: int, cached: int, nanos: int,
                wall: float) -> None:
        h = self._at(tenant, model, wall)
        h.requests += 1
        h.prompt += prompt
        h.completion += completion
        h.cached += cached
        h.nanos += nanos

    def refused(self, tenant: str, model: str, reason: str, wall: float) -> None:
        self._at(tenant, model, wall).refusals[reason] += 1

    def _forget_before(self, hour: int) -> None:
        for k in [k for k in self._hours if k[2] < hour]:
            del self._hours[k]

    def report(self) -> dict[str, Any]:
        """The last hours' cumulative counts: ``{"run", "rows": [...]}``."""
        rows = [{"tenant": t, "model": m, "hour": hour, "requests": h.requests, "prompt_tokens": h.prompt,
                 "completion_tokens": h.completion, "cached_tokens": h.cached, "spend_nanos": h.nanos,
                 "refusals": dict(h.refusals)} for (t, m, hour), h in self._hours.items()]
        return {"run": self.run, "rows": rows}
