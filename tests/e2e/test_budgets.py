"""A tenant's budget through the real Envoy, one replica (budgets in the process).

32 concurrent streams race for a small budget per (calendar) minute: what the clients
received never passes the budget plus one reservation, the engine served exactly what
Sluice settled (nothing lost, nothing counted twice), the refusals are 429 ``budget``
with a Retry-After at the next minute, every answer carries the budget headers, and the
tenant is admitted again once the minute rolls. (A spent budget refused before the body
is read: tests/test_stream_budget.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.budget_load import BudgetLoad, admitted_again, budget_policy
from tests.e2e.fleet import backend_metrics
from tests.e2e.harness import Stack, running

pytestmark = pytest.mark.e2e

BUDGET = 4000  # tokens per minute: ~60 requests of ~65 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("budgets"))
    s.policy_doc = budget_policy(s.sim_port, BUDGET)
    with running(s) as started:
        yield started


def engine_tokens(stack: Stack) -> tuple[float, float]:
    m = backend_metrics(stack.sim_url)
    return m.get("vllm:prompt_tokens_total", 0.0), m.get("vllm:generation_tokens_total", 0.0)


def metric(stack: Stack, series: str) -> float:
    for line in stack.metrics_text().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in /metrics")


def budget_books(stack: Stack) -> dict[str, Any]:
    return stack.state()["budgets"]["ledgers"]


def test_32_streams_never_pass_the_budget_and_are_admitted_again_next_period(stack: Stack) -> None:
    prompt0, gen0 = engine_tokens(stack)
    spent0 = budget_books(stack)["tokens"]["spent"]
    load = BudgetLoad(stack.url, clients=32)
    asyncio.run(load.run())
    summary = load.summary()
    sums = load.check_within_budget(BUDGET)
    refused = load.check_refusals(BUDGET)
    load.check_headers(BUDGET)
    assert set(summary) <= {"200", "429 budget"}, summary
    assert max(sums.values()) >= BUDGET * 0.9, f"the budget was not used up: {sums}"
    # Nothing lost: the engine served exactly what the clients received, and Sluice charged that.
    stack.wait_settled()
    prompt, completion = load.received()
    prompt1, gen1 = engine_tokens(stack)
    assert (prompt1 - prompt0, gen1 - gen0) == (prompt, completion)
    books = budget_books(stack)
    assert books["tokens"]["spent"] - spent0 == prompt + completion
    assert books["balanced"] and books["tokens"]["outstanding"] == 0
    assert books["tokens"]["excess"] == 0, "Sluice reserved at least what the engine used"
    # The minute rolls: the tenant is admitted again, in the next period.
    last = max(a.period for a in refused if a.period)
    again = asyncio.run(admitted_again(stack.url, last))
    assert again.period and again.period > last
    # The new period's budget, less what the load's last requests spent in it (a load that
    # ran into the roll: 680 tokens on a slow host) and this request's own reservation.
    spent_since = sum(a.prompt + a.completion for a in load.answers if a.status == 200 and a.period == again.period)
    assert int(again.headers["x-ratelimit-remaining-budget-tokens"]) >= BUDGET - spent_since - 200, spent_since
    # Prometheus says the same (the budget gauges refresh once a second).
    assert metric(stack, 'sluice_requests_total{outcome="budget",tenant="t-budget"}') >= len(refused)
    assert metric(stack, 'sluice_budget_limit{tenant="t-budget",unit="tokens"}') == BUDGET
    assert metric(stack, 'sluice_usage_tokens_total{kind="completion",model="sim-llama-8b",tenant="t-budget"}') \
        == completion + again.completion
