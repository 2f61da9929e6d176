"""The Redis client every store part uses: one socket timeout for connecting and answering,
and no retries of its own (a retry would hide an outage the store's breaker must see)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["connect"]


def connect(url: str, socket_timeout_s: float) -> aioredis.Redis:
    return aioredis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                             retry=Retry(NoBackoff(), 0), health_check_interval=0)
