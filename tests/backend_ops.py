"""Taking a slot the way a tier with a queue does, for tests that drive ``BackendState`` directly."""

from __future__ import annotations

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy import admit
from extproc.policy.decision import Queue
from extproc.policy.slots import Denied


def try_acquire(be: BackendState, tier: str, tenant: str, cap: int | None, kv: int, now: float,
                prefix: tuple[int, ...] = ()) -> Hold | Denied:
    """``BackendState.acquire`` as a ``Hold`` or the ``Denied`` cause."""
    got = be.acquire(admit.SlotRequest(tier, tenant, cap, kv), now, prefix)
    if isinstance(got, Hold):
        return got
    assert got.cause is not None, got
    return Denied(got.cause, got.detail if isinstance(got, Queue) else got.message)
