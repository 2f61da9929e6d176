"""The state seam: what the adapter needs from wherever admission state lives.

``LocalState`` (this process's memory) is the default. A shared store for many
extproc replicas (Redis with atomic scripts, slot leases with TTLs) implements the
same methods; the pure pieces in this package (buckets, slot pools, breakers, the
queue) do not change, and the test suite runs against every implementation
(``tests/test_policy_gate.py`` is parametrized over ``STATE_IMPLEMENTATIONS``).

``extproc.store.RedisState`` is the shared one (buckets in Redis, a local lease per
replica). Its ``admit`` answers from the lease synchronously when it can and returns
an awaitable otherwise (the request waits for one Redis round trip); callers await
anything that is not a ``Verdict``. A ``force``d charge never waits. It lives outside
this package (it does I/O), so the suite runs it besides this list.

Slot, KV and breaker state are still held per process by ``extproc.backends.state``; moving
them behind this seam is the next step toward many replicas.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from extproc.policy.bucket import Ledger
from extproc.policy.budget import Amount, Budget
from extproc.policy.budget_ledger import BudgetHold, BudgetLedgers, BudgetVerdict, BudgetView
from extproc.policy.gate import LocalState, RateView, Verdict
from extproc.policy.model import Limits


class TokenState(Protocol):
    ledger: Ledger
    in_flight: int

    def admit(self, tenant: str, limits: Limits, cost: int, now: float, scale: float | None = None,
              force: bool = False) -> Verdict | Awaitable[Verdict]: ...

    def peek(self, tenant: str, limits: Limits, cost: int, now: float) -> Verdict: ...

    def spend(self, tenant: str, limits: Limits, tokens: int, now: float) -> None: ...

    def settle(self, tenant: str, reserved: int, actual: int, now: float) -> None: ...

    def view(self, tenant: str, limits: Limits, now: float) -> tuple[RateView, RateView]: ...

    def forget(self, keep: set[str]) -> None: ...

    def snapshot(self, now: float) -> dict[str, Any]: ...


class BudgetState(Protocol):
    """Where budget books live (``LocalBudgets``, or ``extproc.store.budgets.RedisBudgets``
    beside a shared TokenState); ``admit`` may return an awaitable, as TokenState's."""

    shared: bool
    ledgers: BudgetLedgers

    def admit(self, tenant: str, budget: Budget, cost: Amount, wall: float,
              force: bool = False) -> BudgetVerdict | Awaitable[BudgetVerdict]: ...

    def settle(self, hold: BudgetHold, actual: Amount, wall: float) -> None: ...

    def view(self, tenant: str, budget: Budget, wall: float) -> BudgetView: ...

    def seed(self, tenant: str, key: str, settled: Amount) -> None: ...

    def forget(self, keep: set[str]) -> None: ...

    def report(self, wall: float) -> list[dict[str, Any]]: ...

    def snapshot(self, wall: float) -> dict[str, Any]: ...


STATE_IMPLEMENTATIONS: tuple[type[TokenState], ...] = (LocalState,)
