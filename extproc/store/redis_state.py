"""TPM/RPM shared by every replica: the bucket in Redis, a local lease per replica.

The TokenState seam (``extproc.policy.state``) with the buckets in Redis: one Lua
script per exchange (``scripts.EXCHANGE``, Redis ``TIME`` as the clock, debt allowed,
settles exact). A replica admits from its local lease (``extproc.policy.lease``)
synchronously, as fast as ``LocalState``; when the lease cannot cover a request,
``admit`` returns an awaitable and the request waits for one exchange, which carries
every request of that tenant waiting at that moment, the settles not yet sent, and
brings back a new lease. A background task sends settles within ``flush_s``, refills
leases running low ahead of need, renews expiring ones and heartbeats the registry.

Redis unreachable (an error, or an exchange slower than recent answers allow, at least
``admit_wait_s``: ``extproc.store.round_trips``): the store's
breaker opens, ``sluice_state_store_up`` drops to 0, and admission continues from
unexpired leases, then from a local share of the bucket (limit / the most replicas
seen in the last registry ttl that Redis answered, ``Registry.most_seen``), or is refused
(``fail_closed``). A probe every ``probe_s`` closes the breaker; every charge made meanwhile reaches Redis in the
tenant's next exchange, before Redis admits anything beyond the local share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from extproc.policy.bucket import Ledger
from extproc.policy.gate import RateView, Verdict
from extproc.policy.lease import TenantLease, local_share
from extproc.policy.reasons import Reason
from extproc.policy.schema import Limits
from extproc.store.breaker import StoreBreaker
from extproc.store.client import connect
from extproc.store.exchange import STORE_ERRORS, Exchanges
from extproc.store.registry import Registry
from extproc.store.round_trips import RoundTrips
from extproc.store.scripts import EXCHANGE

log = logging.getLogger("sluice.store")

class RedisState(Exchanges):
    """TokenState over Redis; see the module docstring (the round trips: ``extproc.store.exchange``)."""

    shared = True

    def __init__(self, url: str | None = None, *, client: aioredis.Redis | None = None, replica_id: str,
                 prefix: str = "sluice", caller_clock: bool = False, background: bool = True,
                 lease_ttl_s: float = 5.0, flush_s: float = 0.05, registry_ttl_s: float = 10.0,
                 admit_wait_s: float = 0.008, socket_timeout_s: float = 0.1, probe_s: float = 0.05,
                 slice_fraction: float = 0.1, holder_grace_s: float = 3600.0, fail_closed: bool = False,
                 on_store_up: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if client is None:
            if url is None:
                raise ValueError("RedisState needs a url or a client")
            client = connect(url, socket_timeout_s)
        self.url, self.client, self.prefix = url, client, prefix
        self.caller_clock, self.background = caller_clock, background
        self.lease_ttl_s, self.flush_s, self.admit_wait_s = lease_ttl_s, flush_s, admit_wait_s
        self.probe_s, self.slice_fraction, self.holder_grace_s = probe_s, slice_fraction, holder_grace_s
        self.fail_closed, self.clock, self.socket_timeout_s = fail_closed, clock, socket_timeout_s
        # How long an answer may take before the store counts as unreachable: admit_wait_s
        # on a quiet host, what recent answers took on a busy one (extproc.store.round_trips).
        self.round_trips = RoundTrips(admit_wait_s, socket_timeout_s)
        self.heartbeat_stalls = 0  # heartbeats timed out and sent again (a starved process, or once)
        self.ledger = Ledger()
        self.in_flight = 0
        self.registry = Registry(replica_id, prefix, registry_ttl_s)
        self._script = client.register_script(EXCHANGE)
        self._tenants: dict[str, TenantLease] = {}
        self.breaker = StoreBreaker(probe_s, on_store_up, clock)
        self.exchanges = 0  # round trips that carried at least one request (for the bench)
        self._task: asyncio.Task[None] | None = None
        self._register: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        # Others sharing this connection (budgets) send what they hold within flush_s too.
        self.flushers: list[Callable[[], Awaitable[None]]] = []

    @property
    def up(self) -> bool:
        return self.breaker.up

    # -- the TokenState protocol ----------------------------------------------------
    def admit(self, tenant: str, limits: Limits, cost: int, now: float, scale: float | None = None,
              force: bool = False) -> Verdict | Awaitable[Verdict]:
        self._ensure_started()
        ls = self._lease(tenant, limits, scale)
        if not force and cost > limits.burst_tokens:
            tv, rv = ls.view(now)
            return Verdict(False, tv, rv, Reason.TPM_REQUEST_TOO_LARGE,
                           f"Request needs {cost} tokens, more than the {limits.burst_tokens} this key may use "
                           "at once. Lower max_tokens or shorten the prompt.", math.inf)
        if ls.try_spend(limits, cost, ls.scale, now):
            if ls.low():
                self._poke()
            return self._admitted(ls, cost, now)
        if force:
            # Shadow mode keeps honest books: charged now, sent with the next exchange.
            ls.debit += cost
            ls.debit_r += 1
            if ls.fallback is not None:
                ls.fallback[0].settle(0, cost, now)
                ls.fallback[1].settle(0, 1, now)
            self._poke()
            return self._admitted(ls, cost, now)
        if not self.up:
            return self._from_local_share(ls, cost, now)
        return self._admit_remote(tenant, ls, cost, now)

    def peek(self, tenant: str, limits: Limits, cost: int, now: float) -> Verdict:
        """What ``admit`` would likely say, from the lease and the store's last answer: no round trip.

        A refusal before any work (the body is not even read), so it refuses only on what
        the store last said, less what this replica charged since; a tenant the store has
        not answered for yet is let through for ``admit`` to decide.
        """
        ls = self._tenants.get(tenant)
        if ls is None or ls.forgotten or ls.level_t is None:
            return Verdict(True, *self.view(tenant, limits, now))
        ls.limits = limits
        tv, rv = ls.view(now)
        if ls.fallback is not None:
            # The local share's bucket already counts what it admitted (Redis down): the
            # debits waiting for Redis are those, not to be taken off a second time.
            room = ls.fallback[0].remaining(now) + ls.lease_t
        else:
            # The raw level (the view floors debt at 0), less what the store has not heard yet.
            room = ls.estimate_t(now) + ls.lease_t - ls.unsent_t()
        if room >= cost and rv.remaining >= 1:
            return Verdict(True, tv, rv)
        tpm_wait = max(0.0, cost - room) / max(limits.tpm * ls.scale / 60.0, 1e-9)
        rpm_wait = 0.0 if rv.remaining >= 1 else 60.0 / max(limits.rpm, 1)
        return self._refused(ls, cost, now, tpm_wait, rpm_wait)

    def spend(self, tenant: str, limits: Limits, tokens: int, now: float) -> None:
        """Charge a refused prompt's counting: a debit sent with the next exchange."""
        self._ensure_started()
        ls = self._lease(tenant, limits, None)
        ls.debit += tokens
        if ls.fallback is not None:
            ls.fallback[0].settle(0, tokens, now)
        self.ledger.record_precharge(tokens)
        self.ledger.record_settle(tokens, tokens)
        self._poke()

    def settle(self, tenant: str, reserved: int, actual: int, now: float) -> None:
        ls = self._tenants.get(tenant)
        if ls is not None and not ls.forgotten:
            if reserved >= actual:
                ls.credit += reserved - actual
            else:
                ls.debit += actual - reserved
            if ls.fallback is not None:
                ls.fallback[0].settle(reserved, actual, now)
        self.ledger.record_settle(reserved, actual)
        self.in_flight -= 1

    def view(self, tenant: str, limits: Limits, now: float) -> tuple[RateView, RateView]:
        """The last level Redis reported, refilled since, plus this replica's lease (no round trip)."""
        ls = self._tenants.get(tenant)
        if ls is None or ls.forgotten:
            return (RateView(limits.tpm, limits.burst_tokens, 0.0), RateView(limits.rpm, limits.rpm, 0.0))
        ls.limits = limits
        return ls.view(now)

    def forget(self, keep: set[str]) -> None:
        """Tenants gone from the policy: their leases go back with a last exchange."""
        for name, ls in self._tenants.items():
            if name not in keep:
                ls.forgotten = True
        self._poke()

    def snapshot(self, now: float) -> dict[str, Any]:
        buckets = {}
        for name, ls in self._tenants.items():
            if not ls.forgotten:
                tv, rv = ls.view(now)
                buckets[name] = {"tokens": tv.remaining, "requests": rv.remaining}
        return {
            "in_flight": self.in_flight,
            "ledger": {"precharged": self.ledger.precharged, "charged": self.ledger.charged,
                       "refunded": self.ledger.refunded, "excess": self.ledger.excess,
                       "outstanding": self.ledger.outstanding, "balanced": self.ledger.balanced()},
            "buckets": buckets,
            "store": {"kind": "redis", "up": self.up, "member": self.registry.member,
                      "replicas": self.registry.live, "trips": self.breaker.trips},
        }

    # -- local pieces ---------------------------------------------------------------
    def _lease(self, tenant: str, limits: Limits, scale: float | None) -> TenantLease:
        ls = self._tenants.get(tenant)
        if ls is None:
            ls = self._tenants[tenant] = TenantLease(limits)
        ls.forgotten = False
        ls.limits = limits
        if scale is not None:
            ls.scale = scale
        return ls

    def _admitted(self, ls: TenantLease, cost: int, now: float) -> Verdict:
        self.ledger.record_precharge(cost)
        self.in_flight += 1
        tv, rv = ls.view(now)
        return Verdict(True, tv, rv)

    def _refused(self, ls: TenantLease, cost: int, now: float, tpm_wait: float, rpm_wait: float) -> Verdict:
        tv, rv = ls.view(now)
        lim = ls.limits
        if rpm_wait >= tpm_wait:
            return Verdict(False, tv, rv, Reason.RPM, f"Rate limit reached: {lim.rpm} requests per minute.", rpm_wait)
        return Verdict(False, tv, rv, Reason.TPM,
                       f"Rate limit reached: {lim.tpm} tokens per minute; this request needs {cost}.", tpm_wait)

    def _from_local_share(self, ls: TenantLease, cost: int, now: float) -> Verdict:
        n = self.registry.most_seen(now)
        if self.fail_closed or n is None:
            tv, rv = ls.view(now)
            return Verdict(False, tv, rv, Reason.STATE_STORE_DOWN,
                           "The shared rate-limit store is unreachable; retry shortly.", 1.0)
        if ls.fallback is None:
            ls.fallback = local_share(ls, ls.limits, n, now)
        tb, rb = ls.fallback
        need = min(tb.capacity, cost + ls.headroom(ls.limits, ls.scale) / n)
        rpm_wait = max(0.0, 1 - rb.remaining(now)) / max(rb.rate_per_s, 1e-9)
        tpm_wait = max(0.0, need - tb.remaining(now)) / max(tb.rate_per_s, 1e-9)
        if rpm_wait > 0 or tpm_wait > 0:
            return self._refused(ls, cost, now, tpm_wait, rpm_wait)
        tb.settle(0, cost, now)
        rb.settle(0, 1, now)
        ls.debit += cost
        ls.down += cost
        ls.debit_r += 1
        return self._admitted(ls, cost, now)

    def _trip(self, why: str) -> None:
        self.breaker.trip(why)
        self.registry.down()  # the replica counts seen do not age while it is down
        for ls in self._tenants.values():
            self._release(ls, [])

    def _answered(self) -> None:
        if self.breaker.answered():
            self._poke()  # reconcile every tenant that ran on its local share

    def trip(self, why: str) -> None:
        """Another user of this connection (shared budgets) found Redis unreachable."""
        self._trip(why)

    def answered(self) -> None:
        """Another user of this connection got an answer from Redis."""
        self._answered()

    async def _beat(self, now: float) -> None:
        fenced = await self.registry.beat(self.client, repr(now) if self.caller_clock else "", self.clock())
        if fenced:
            for ls in self._tenants.values():  # what the old member held is gone
                ls.granted_t, ls.granted_r = ls.spent_t, ls.spent_r

    async def _first_contact(self, now: float) -> None:
        await self._beat(now)
        await self.client.script_load(EXCHANGE)  # so no exchange pays for compiling it

    async def _registered(self, now: float) -> bool:
        if self._register is None or self._register.done():
            self._register = asyncio.get_running_loop().create_task(self._first_contact(now))
        # The first contact connects and loads the script: allow it the socket timeout.
        done, _ = await asyncio.wait({self._register}, timeout=max(self.admit_wait_s, 3 * self.socket_timeout_s))
        if not done or self._register.exception() is not None:
            self._trip("registration failed" if done else "registration timed out")
            return False
        return True

    # -- the background task ----------------------------------------------------------
    def start(self) -> None:
        """Register and start the background task now, if an event loop runs (else at first use)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is not None or not self.background or self._closing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        unanswered = False  # the last heartbeat timed out
        while not self._closing:
            now = self.clock()
            if not self.registry.member:
                await self._registered(now)  # shared with a request that may be registering too
            elif self.up and self.registry.due(now) or self.breaker.probe_due(now):
                try:
                    # asyncio.timeout, not wait_for, in a loop that is cancelled to stop: see
                    # SlotLeases.wait (Python 3.11's wait_for can drop a cancel)
                    loop = asyncio.get_running_loop()
                    started = loop.time()
                    limit = max(self.probe_s, 0.05, 2 * self.round_trips.bound())
                    async with asyncio.timeout(limit):
                        await self._beat(now)
                    self.round_trips.observe(loop.time() - started)
                except STORE_ERRORS as exc:
                    timed_out = isinstance(exc, (TimeoutError, redis.TimeoutError))
                    if timed_out and loop.time() - started > 2 * limit:
                        # The timer fired far past its time: this process was not running (a
                        # starved host), and an answer already read loses to the timer. Not
                        # Redis's fault: beat again rather than send every request local.
                        self.heartbeat_stalls += 1
                        continue
                    if timed_out and self.up and not unanswered:
                        # One heartbeat past the socket's timeout on a loaded host (Redis or
                        # this process descheduled ~100 ms; seen while a demo's replicas
                        # started beside a test suite) is not an outage: beat once more. Only
                        # an idle replica waits for the second, as a request's exchange has
                        # its own watchdog (_overdue); a refused connection trips at once.
                        unanswered = True
                        self.heartbeat_stalls += 1
                        continue
                    self._trip(f"heartbeat: {type(exc).__name__}: {exc}")
                else:
                    unanswered = False
                    self._answered()
            if self.up:
                await self.sync(self.clock(), only_due=True)
                for flush in self.flushers:
                    try:
                        await flush()
                    except Exception:  # noqa: BLE001 - one user's bug must not stop the others' flushes
                        log.exception("state store: a flush failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_s):
                    await self._wake.wait()

    async def sync(self, now: float, tenants: list[str] | None = None, only_due: bool = False) -> None:
        """One exchange for each tenant that needs one (settles to send, a lease low or expiring)."""
        if not self.registry.member and not await self._registered(now):
            return
        tasks = []
        for name in list(self._tenants) if tenants is None else tenants:
            ls = self._tenants.get(name)
            if ls is None:
                continue
            if ls.inflight is None and self.up:
                expiring = ls.lease_t > 0 and now > ls.expires - self.lease_ttl_s / 3
                due = ls.forgotten or ls.dirty() or ls.low() or ls.fallback is not None or expiring
                if due or not only_due:
                    # A lease nobody touched since it was granted goes back without a new one:
                    # idle tenants cost no round trips.
                    idle = expiring and ls.spent_t == ls.spent_at_grant and not ls.dirty()
                    self._begin(name, ls, now, want=not (only_due and idle))
            if ls.inflight is not None:
                tasks.append(ls.inflight)
        if tasks:
            await asyncio.wait(tasks)
        for name in list(self._tenants):
            ls = self._tenants[name]
            if ls.forgotten and ls.inflight is None and not ls.dirty() and ls.lease_t == 0 and not ls.waiters:
                del self._tenants[name]

    async def aclose(self) -> None:
        """Give every lease back and leave the registry (a clean shutdown)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.up and self.registry.member:
            with contextlib.suppress(*STORE_ERRORS):
                await self.sync(self.clock() if not self.caller_clock else 0.0)
                await self.client.zrem(self.registry.keys[0], self.registry.member)

    def close(self) -> None:
        """Synchronous shutdown for ``Runtime.close``: leases back through a blocking client."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        if self.url is None or not self.registry.member:
            return
        try:
            c = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
            script = c.register_script(EXCHANGE)
            now = self.clock()
            for name, ls in self._tenants.items():
                if ls.inflight is None and (ls.lease_t > 0 or ls.dirty()):
                    script(keys=[f"{self.prefix}:tb:{name}", self.registry.keys[0]],
                           args=self._args(ls, now, [], want=False))
            c.zrem(self.registry.keys[0], self.registry.member)
            c.close()
        except (redis.RedisError, OSError) as exc:
            log.warning("state store: leases not returned at shutdown (%s); they expire in %.0fs",
                        exc, self.lease_ttl_s)
