"""What every request handler reads: the app's store, policy state and settings, in one object.

Its own module so that the views can name its type without importing the app factory
(which imports the views).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from console.config import ConsoleConfig
from console.policystate import PolicyState
from console.store import Store
from console.throttle import Hashing, Throttle


@dataclass
class Sluice:
    """Everything a request handler needs, at ``current_app.extensions["sluice"]``."""

    config: ConsoleConfig
    store: Store
    state: PolicyState
    api_token: str
    clock: Any
    throttle: Throttle = field(default_factory=Throttle)
    hashing: Hashing = field(default_factory=lambda: Hashing(1))
    last_prune: float = field(default=float("-inf"))

    def now(self) -> float:
        return float(self.clock())

    def close(self) -> None:
        self.store.close()
