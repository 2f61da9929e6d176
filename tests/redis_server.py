"""A real ``redis-server`` (Debian package) per test module, on a random port.

Import the fixtures where they are used (``from tests.redis_server import
redis_server_fixture``); the fixture's name is ``redis_server``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.redis_server import RedisServer
from extproc.policy.bucket import Ledger
from extproc.policy.gate import RateView, Verdict
from extproc.policy.schema import Limits
from extproc.store.client import connect
from extproc.store.redis_state import RedisState


@pytest.fixture(scope="module", name="redis_server")
def redis_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


class SyncRedisState:
    """RedisState driven synchronously, for the gate suite (tests/test_policy_gate.py).

    The suite moves time by assignment, so the Redis scripts take the caller's ``now``
    (the implementation's clock seam) instead of Redis ``TIME``. Each call that would
    wait for Redis, or that the background task would flush within ``flush_s``, runs
    its exchange to the end before returning; leases never expire (the suite checks
    the bucket, tests/test_state_redis.py checks the leases).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, client: Any, prefix: str) -> None:
        self.loop = loop
        self.inner = RedisState(client=client, replica_id="gate", prefix=prefix, caller_clock=True,
                                background=False, lease_ttl_s=1e9, admit_wait_s=5.0)
        self.now = 0.0

    @property
    def ledger(self) -> Ledger:
        return self.inner.ledger

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight

    def _sync(self, now: float, tenants: list[str] | None = None) -> None:
        self.now = now
        self.loop.run_until_complete(self.inner.sync(now, tenants))

    def admit(self, tenant: str, limits: Limits, cost: int, now: float, scale: float | None = None,
              force: bool = False) -> Verdict:
        self.now = now
        v = self.inner.admit(tenant, limits, cost, now, scale, force)
        if not isinstance(v, Verdict):
            v = self.loop.run_until_complete(v)  # type: ignore[arg-type]
        if force:
            self._sync(now, [tenant])
        return v

    def peek(self, tenant: str, limits: Limits, cost: int, now: float) -> Verdict:
        self.now = now
        return self.inner.peek(tenant, limits, cost, now)

    def spend(self, tenant: str, limits: Limits, tokens: int, now: float) -> None:
        self.inner.spend(tenant, limits, tokens, now)
        self._sync(now, [tenant])

    def settle(self, tenant: str, reserved: int, actual: int, now: float) -> None:
        self.inner.settle(tenant, reserved, actual, now)
        self._sync(now, [tenant])

    def view(self, tenant: str, limits: Limits, now: float) -> tuple[RateView, RateView]:
        ls = self.inner._tenants.get(tenant)
        if ls is not None:
            ls.limits = limits
            self._sync(now, [tenant])
        return self.inner.view(tenant, limits, now)

    def forget(self, keep: set[str]) -> None:
        self.inner.forget(keep)
        self._sync(self.now)

    def snapshot(self, now: float) -> dict[str, Any]:
        self._sync(now)
        return self.inner.snapshot(now)


@pytest.fixture(scope="module", name="redis_state_factory")
def redis_state_factory_fixture(redis_server: RedisServer) -> Iterator[Callable[[], SyncRedisState]]:
    """Makes SyncRedisStates on one server, each under its own key prefix (its own buckets)."""
    loop = asyncio.new_event_loop()
    client = connect(redis_server.url, socket_timeout_s=5.0)
    counter = itertools.count()

    def make() -> SyncRedisState:
        return SyncRedisState(loop, client, f"gate{next(counter)}")

    try:
        yield make
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
