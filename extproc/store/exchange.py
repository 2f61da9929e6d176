"""RedisState's round trips: one exchange script carrying a tenant's waiting requests.

``_begin`` sends one ``scripts.EXCHANGE`` for a tenant with every request of it
waiting at that moment, the settles not yet sent and the lease going back; the reply
brings the bucket's level, a new lease and a verdict per request. A watchdog trips
the store's breaker when no answer comes within the bound recent answers set
(``round_trips``: ``admit_wait_s`` on a quiet host, more on a busy one; after making
sure it was Redis that was slow, not this event loop), and the waiting requests fall
back to the local share. Split from ``extproc.store.redis_state`` (the TokenState protocol,
the local pieces, the background task); the attributes below are RedisState's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import redis

from extproc.policy.gate import Verdict
from extproc.policy.lease import TenantLease
from extproc.store.registry import Registry
from extproc.store.round_trips import RoundTrips

ADMITTED = "admitted"
FALLBACK = "fallback"
STORE_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


def _f(x: Any) -> float:
    return float(x.decode() if isinstance(x, bytes) else x)


class Exchanges:
    """The exchange machinery of ``RedisState`` (a base class: it holds no state of its own)."""

    _script: Any
    prefix: str
    registry: Registry
    slice_fraction: float
    lease_ttl_s: float
    holder_grace_s: float
    admit_wait_s: float
    round_trips: RoundTrips
    caller_clock: bool
    clock: Callable[[], float]
    exchanges: int
    _closing: bool

    @property
    def up(self) -> bool:
        raise NotImplementedError

    def _trip(self, why: str) -> None:
        raise NotImplementedError

    def _answered(self) -> None:
        raise NotImplementedError

    def _admitted(self, ls: TenantLease, cost: int, now: float) -> Verdict:
        raise NotImplementedError

    def _refused(self, ls: TenantLease, cost: int, now: float, tpm_wait: float, rpm_wait: float) -> Verdict:
        raise NotImplementedError

    def _from_local_share(self, ls: TenantLease, cost: int, now: float) -> Verdict:
        raise NotImplementedError

    async def _registered(self, now: float) -> bool:
        raise NotImplementedError

    async def _admit_remote(self, tenant: str, ls: TenantLease, cost: int, now: float) -> Verdict:
        if not self.registry.member and not await self._registered(now):
            return self._from_local_share(ls, cost, now)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ls.waiters.append((cost, fut))
        if ls.inflight is None:
            self._begin(tenant, ls, now)
        got = await fut
        if got == ADMITTED:
            return self._admitted(ls, cost, now)
        if got == FALLBACK:
            return self._from_local_share(ls, cost, now)
        return self._refused(ls, cost, now, *got)

    def _args(self, ls: TenantLease, now: float, costs: list[int], want: bool) -> list[str]:
        lim, scale = ls.limits, ls.scale
        cap_t = max(1, math.floor(self.slice_fraction * lim.burst_tokens))
        cap_r = max(1, math.floor(self.slice_fraction * lim.rpm))
        c0, d0, r0 = ls.sent
        nums = (float(lim.burst_tokens), lim.tpm * scale / 60.0, float(lim.rpm), lim.rpm / 60.0,
                ls.spent_t, ls.spent_r, ls.credit, ls.debit, ls.debit_r, c0, d0, r0,
                ls.headroom(lim, scale), self.lease_ttl_s, self.registry.live, cap_t, cap_r, 1 if want else 0,
                self.holder_grace_s, ls.estimate_t(now), ls.estimate_r(now), ls.down, ls.down_sent,
                ls.estimate_raw_t(now))
        return [self.registry.member, repr(now) if self.caller_clock else "", " ".join(map(repr, nums)),
                " ".join(map(str, costs))]

    def _begin(self, tenant: str, ls: TenantLease, now: float, want: bool = True) -> None:
        """Send one exchange carrying every request of this tenant waiting now."""
        waiters, ls.waiters = ls.waiters, []
        want = want and not ls.forgotten and not self._closing
        args = self._args(ls, now, [c for c, _ in waiters], want)
        sent = (ls.credit, ls.debit, ls.debit_r, ls.down)
        # The lease goes back with this exchange: nothing more is spent from it.
        ls.granted_t, ls.granted_r = ls.spent_t, ls.spent_r
        ls.lease_limits, ls.lease_scale = ls.limits, ls.scale
        if waiters:
            self.exchanges += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._exchange(tenant, ls, args, waiters, sent, now))
        ls.inflight = task
        self._arm(loop, ls, task, waiters, loop.time() + self.round_trips.bound())

    def _arm(self, loop: asyncio.AbstractEventLoop, ls: TenantLease, task: asyncio.Task[None],
             waiters: list[tuple[int, Any]], due: float) -> None:
        watchdog = loop.call_at(due, self._overdue, loop, ls, task, waiters, due)
        task.add_done_callback(lambda _: watchdog.cancel())

    async def _exchange(self, tenant: str, ls: TenantLease, args: list[str], waiters: list[tuple[int, Any]],
                        sent: tuple[float, float, float, float], now: float) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reply = await self._script(keys=[f"{self.prefix}:tb:{tenant}", self.registry.keys[0]], args=args)
        except STORE_ERRORS as exc:
            ls.inflight = None
            self._trip(f"{type(exc).__name__}: {exc}")
            self._release(ls, waiters)
            return
        except asyncio.CancelledError:
            ls.inflight = None
            self._release(ls, waiters)  # nobody waits forever on an exchange that will not finish
            raise
        ls.inflight = None
        self.round_trips.observe(loop.time() - started)
        self._answered()
        tl, rl, g, q = (_f(x) for x in reply[:4])
        self.registry.observe(int(_f(reply[4])), self.clock())
        ls.level_t, ls.level_r, ls.seen_at = tl, rl, now
        ls.granted_t, ls.granted_r = g, q
        ls.sent, ls.down_sent = (sent[0], sent[1], sent[2]), sent[3]
        ls.expires = now + self.lease_ttl_s * 0.9  # Redis's deadline is later: its clock started after ours
        ls.fallback = None  # reconciled: every charge made without Redis is in its books now
        for i, (cost, fut) in enumerate(waiters):
            tw, rw = _f(reply[5 + 2 * i]), _f(reply[6 + 2 * i])
            if tw == 0 and rw == 0:
                # Redis counts what it admitted as spent at once (only the slice is a lease).
                ls.spent_t += cost
                ls.spent_r += 1
                if fut.done():
                    ls.credit += cost  # the request left (or fell back): its tokens go back as a refund
                else:
                    fut.set_result(ADMITTED)
            elif not fut.done():
                fut.set_result((tw, rw))
        ls.last_slice = ls.lease_t
        ls.spent_at_grant = ls.spent_t
        if ls.waiters and self.up:
            self._begin(tenant, ls, self.clock() if not self.caller_clock else now)

    def _overdue(self, loop: asyncio.AbstractEventLoop, ls: TenantLease, task: asyncio.Task[None],
                 waiters: list[tuple[int, Any]], due: float, rechecks: int = 0) -> None:
        if task.done():
            return
        bound = self.round_trips.bound()
        lag = loop.time() - due
        if lag > bound / 4 and rechecks < 4:
            # This loop was busy, not Redis slow: a reply may be read and not yet handled.
            self._arm_recheck(loop, ls, task, waiters, rechecks)
            return
        if rechecks == 0:
            # One more turn of the loop: a reply read in this turn wakes its task in the next.
            loop.call_soon(self._overdue, loop, ls, task, waiters, loop.time(), 4)
            return
        self._trip(f"no answer within {bound * 1000:.0f} ms")
        self._release(ls, waiters)

    def _arm_recheck(self, loop: asyncio.AbstractEventLoop, ls: TenantLease, task: asyncio.Task[None],
                     waiters: list[tuple[int, Any]], rechecks: int) -> None:
        due = loop.time() + self.round_trips.bound() / 4
        watchdog = loop.call_at(due, self._overdue, loop, ls, task, waiters, due, rechecks + 1)
        task.add_done_callback(lambda _: watchdog.cancel())

    def _release(self, ls: TenantLease, carried: list[tuple[int, Any]]) -> None:
        waiting, ls.waiters = ls.waiters, []
        for _, fut in [*carried, *waiting]:
            if not fut.done():
                fut.set_result(FALLBACK)
