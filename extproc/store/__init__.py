"""Where admission state lives when it must be shared by many extproc replicas.

``open_state`` picks the implementation of the TokenState seam
(``extproc.policy.state``): ``LocalState`` for ``gateway.state: memory`` (the
default), ``RedisState`` for a Redis URL (or ``$SLUICE_REDIS_URL``, which wins).
Slot and KV leases (``slot_leases``, ``lease_plan``) and shared breakers use the same
connection and registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from extproc.policy.budget_ledger import LocalBudgets
from extproc.policy.gate import LocalState
from extproc.policy.schema import Gateway
from extproc.policy.state import BudgetState, TokenState

ENV_URL = "SLUICE_REDIS_URL"


def state_url(gateway: Gateway) -> str:
    """The configured store: ``memory`` or a Redis URL (anything else: shared by replicas)."""
    return os.environ.get(ENV_URL) or gateway.state


def open_state(gateway: Gateway, replica_id: str, on_store_up: Callable[[bool], None] | None = None) -> TokenState:
    url = state_url(gateway)
    if url == "memory":
        if on_store_up is not None:
            on_store_up(True)
        return LocalState()
    from extproc.store.redis_state import RedisState

    return RedisState(url, replica_id=replica_id, fail_closed=gateway.state_fail_closed, on_store_up=on_store_up)


def open_budgets(gateway: Gateway, state: TokenState) -> BudgetState:
    """The budget books beside ``state``: in this process, or in the same Redis (its
    connection, registry and breaker): ``LocalBudgets`` or ``RedisBudgets``."""
    if not getattr(state, "shared", False):
        return LocalBudgets(gateway.currency)
    from extproc.store.budgets import RedisBudgets

    return RedisBudgets(state, currency=gateway.currency, fail_closed=gateway.state_fail_closed)
