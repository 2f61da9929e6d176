"""What the core decides about one request's slot and KV room: ``Admit | Queue | Reject``.

Frozen values with the reason in them, so the adapter (``extproc.request.admission``) only
maps a decision to ext_proc messages and the core is tested as a table of cases.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy.reasons import Cause, Reason
from extproc.policy.slots import PoolName

__all__ = ["ADMIT", "ROOM_CAUSES", "Admit", "Decision", "Queue", "Reject"]


@dataclass(frozen=True, slots=True)
class Admit:
    """Take a slot from ``pool`` and reserve the request's footprint of the cache.

    There are two values (``ADMIT``): admitting allocates nothing on the hot path."""

    pool: PoolName


@dataclass(frozen=True, slots=True)
class Queue:
    """No room now; the request may wait in its tier's queue."""

    cause: Cause
    detail: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request now. ``retry_after_s`` None: retrying the same request cannot help."""

    reason: Reason
    message: str
    code: str
    cause: Cause | None = None  # no room (the slot pool or KV said no); None: the request itself
    param: str | None = None
    retry_after_s: float | None = None


Decision = Admit | Queue | Reject
# No room now: the causes a bigger share of the pool can cure (a shared store's lease
# grows for them, extproc.runtime.leases); a tenant cap, a footprint over the whole
# cache or the context window cannot be cured that way.
ROOM_CAUSES = frozenset({Cause.KV_EXHAUSTED, Cause.SLOTS_EXHAUSTED})
ADMIT: dict[PoolName, Admit] = {"guaranteed": Admit("guaranteed"), "shared": Admit("shared")}
