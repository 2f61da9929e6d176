"""Traffic against a tenant's budget through the real Envoy, and what to check of it.

``BudgetLoad`` runs ``clients`` concurrent streaming chat completions (usage included)
for one key until told to stop, keeping for every answer its status, Sluice's reason,
the budget headers, the usage the client received and when it arrived. The checks are
shared by the one-replica and the fleet tests (tests/e2e/test_budgets.py,
tests/e2e/test_fleet_budgets.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from extproc.policy.schema import hash_key
from tests.e2e import harness

KEY = "sk-test-budget"
MAX_TOKENS = 64
BUDGET_HEADERS = ("x-ratelimit-limit-budget-tokens", "x-ratelimit-remaining-budget-tokens",
                  "x-ratelimit-reset-budget", "x-sluice-budget-period")


def budget_policy(sim_port: int, tokens: int, period: str = "minute", **gateway: Any) -> dict[str, Any]:
    """The test policy with a tier whose tenant ``t-budget`` may use ``tokens`` per ``period``."""
    doc = harness.test_policy(sim_port, **gateway)
    doc["tiers"]["budgeted"] = {"priority": 5, "tpm": 50_000_000, "rpm": 10_000_000, "max_concurrency": 256,
                                "budget": {"period": period, "tokens": tokens}}
    doc["tenants"].append({"name": "t-budget", "tier": "budgeted", "keys": [hash_key(KEY)]})
    return doc


@dataclass
class Answer:
    status: int
    reason: str | None
    headers: dict[str, str]
    prompt: int = 0
    completion: int = 0
    at: float = 0.0  # wall clock when the answer (its last byte) arrived

    @property
    def period(self) -> str | None:
        return self.headers.get("x-sluice-budget-period")


def period_end(label: str) -> float:
    """The end of a ``minute:UTC:<YYYY-MM-DDTHH:MM>`` period (what the tests use)."""
    kind, zone, start = label.split(":", 2)
    assert (kind, zone) == ("minute", "UTC"), label
    return datetime.strptime(start, "%Y-%m-%dT%H:%M").replace(tzinfo=UTC).timestamp() + 60


@dataclass
class BudgetLoad:
    url: str
    clients: int = 32
    answers: list[Answer] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    stop_after_refusals_s: float = 2.0  # keep asking this long after the first budget refusal
    seed: int = 1

    async def one(self, http: httpx.AsyncClient, rng: random.Random) -> Answer | None:
        body = {"model": "sim-llama-8b", "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"count to {rng.randint(1, 99)}"}]}
        headers = {"authorization": f"Bearer {KEY}", "x-sim-tokens": str(rng.randint(8, MAX_TOKENS)),
                   "x-sim-tps": "400"}
        try:
            async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as r:
                raw = await r.aread()
        except httpx.HTTPError as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            return None
        a = Answer(r.status_code, r.headers.get("x-sluice-reason"), {k.lower(): v for k, v in r.headers.items()},
                   at=time.time())
        if r.status_code == 200:
            for line in raw.decode().splitlines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        a.prompt, a.completion = usage["prompt_tokens"], usage["completion_tokens"]
            assert a.prompt > 0, f"a 200 without the usage the client asked for: {raw[-300:]!r}"
        self.answers.append(a)
        return a

    async def run(self, until_refused: bool = True, stop: asyncio.Event | None = None,
                  max_s: float = 50.0) -> None:
        """Until ``stop_after_refusals_s`` after the first budget refusal (or ``stop`` is set)."""
        stop = stop or asyncio.Event()
        first_refusal: list[float] = []
        deadline = time.monotonic() + max_s

        async def client(i: int) -> None:
            rng = random.Random(self.seed * 1000 + i)
            async with httpx.AsyncClient(timeout=30) as http:
                while not stop.is_set() and time.monotonic() < deadline:
                    a = await self.one(http, rng)
                    if a is not None and a.reason == "budget":
                        if not first_refusal:
                            first_refusal.append(time.monotonic())
                        await asyncio.sleep(rng.uniform(0.03, 0.08))
                    if until_refused and first_refusal and \
                            time.monotonic() - first_refusal[0] > self.stop_after_refusals_s:
                        stop.set()

        await asyncio.gather(*(client(i) for i in range(self.clients)))

    # -- what the answers must show ----------------------------------------------------
    def by_period(self) -> dict[str, list[Answer]]:
        out: dict[str, list[Answer]] = {}
        for a in self.answers:
            if a.period is not None:
                out.setdefault(a.period, []).append(a)
        return out

    def check_within_budget(self, budget: int) -> dict[str, int]:
        """Per period: the usage the clients received is at most the budget plus one
        reservation (the bound docs/budgets.md states); returns each period's sum."""
        sums = {}
        for label, answers in self.by_period().items():
            ok = [a for a in answers if a.status == 200]
            used = sum(a.prompt + a.completion for a in ok)
            reservation = max((a.prompt + MAX_TOKENS for a in ok), default=0)
            assert used <= budget + reservation, f"{label}: {used} used of a budget of {budget}"
            sums[label] = used
        return sums

    def check_refusals(self, budget: int, one_replica: bool = True) -> list[Answer]:
        """Budget refusals: 429, Retry-After at the period's end, the budget's headers. With
        one replica what remains is less than a request's reservation; with several it is
        what the refusing replica last heard (during an outage: its local share's view)."""
        refused = [a for a in self.answers if a.reason == "budget"]
        assert refused, f"no budget refusal: {self.summary()}"
        for a in refused:
            assert a.status == 429
            end = period_end(a.period or "")
            wait = int(a.headers["retry-after-ms"]) / 1000
            # The wait to the next period, plus the jitter (at most 1 s); the answer
            # arrived a little after it was decided.
            assert end - a.at - 0.5 <= wait <= end - a.at + 1.5, (a.period, a.at, wait)
            assert int(a.headers["retry-after"]) >= wait - 1e-9
            assert int(a.headers["x-ratelimit-limit-budget-tokens"]) == budget
            left = int(a.headers["x-ratelimit-remaining-budget-tokens"])
            assert 0 <= left < (MAX_TOKENS + 40 if one_replica else budget), left
        return refused

    def check_headers(self, budget: int) -> None:
        for a in self.answers:
            if a.status in (200, 429):
                missing = [h for h in BUDGET_HEADERS if h not in a.headers]
                assert not missing, f"{a.status} {a.reason} lacks {missing}"
                assert int(a.headers["x-ratelimit-limit-budget-tokens"]) == budget
                assert 0 <= int(a.headers["x-ratelimit-remaining-budget-tokens"]) <= budget

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = dict(self.errors)
        for a in self.answers:
            k = f"{a.status} {a.reason or ''}".strip()
            out[k] = out.get(k, 0) + 1
        return out

    def received(self) -> tuple[int, int]:
        ok = [a for a in self.answers if a.status == 200]
        return sum(a.prompt for a in ok), sum(a.completion for a in ok)


async def admitted_again(url: str, after: str, timeout_s: float = 75.0) -> Answer:
    """The first answer admitted in a later period than ``after``: the period rolled."""
    load = BudgetLoad(url, clients=1)
    rng = random.Random(7)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < deadline:
            a = await load.one(http, rng)
            if a is not None and a.status == 200 and a.period is not None and a.period > after:
                return a
            await asyncio.sleep(0.25)
    raise AssertionError(f"not admitted again after {after}: {load.summary()}")
