"""One replica's lease on one pool: what it holds, and what Redis said of the others."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PoolLease:
    """This replica's lease on one backend's pool."""

    pool_slots: int
    pool_kv: int  # 0: the backend has no KV budget
    slots: int = 0
    kv: int = 0
    renew_at: float = -math.inf  # local time of the next renewal
    expires: float = -math.inf  # local deadline of the lease (Redis's is never earlier)
    others: int = 0  # slots the other replicas hold, as of the last exchange
    others_kv: int = 0
    reported: int = 0  # registered members that had reported on this pool, as of the last exchange
    registered: int = 0  # registered members then
