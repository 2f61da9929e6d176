"""Budgets shared by every replica: each tenant's period count in Redis, a lease per replica.

The budget seam (``extproc.policy.budget_ledger``) over Redis, beside the TPM buckets
(``extproc.store.redis_state``, whose connection, registry and store breaker it
shares). Each replica admits from a lease (room Redis set aside for it, at most
``slice_fraction`` of the budget and half the room left over the replicas, none near
the end) synchronously; when the lease cannot cover a request, ``admit`` returns an
awaitable and the request waits for one exchange (``budget_script.BUDGET_EXCHANGE``),
which carries every request of that tenant waiting at that moment and this replica's
settles. The store's background task (``RedisState._run``) sends settles within its
``flush_s``; at shutdown ``close`` sends the last ones.

Redis unreachable (the store breaker open): admission continues from an unexpired
lease, then from a local share of the room this replica last saw (half of it, split
over the replicas it last saw), or is refused with ``state_store_down`` when the
gateway fails closed. Redis restarted empty: the next exchange re-creates the period's
count from the highest settled total any replica saw and the console's durable copy
(``seed``), plus what each replica settled since (see ``budget_script``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from extproc.policy.budget import ZERO, Amount, Budget
from extproc.policy.budget_ledger import (
    BudgetHold,
    BudgetLedgers,
    BudgetVerdict,
    BudgetView,
    period_row,
    refusal,
)
from extproc.policy.period import Span
from extproc.policy.reasons import Reason
from extproc.store.budget_script import BUDGET_EXCHANGE
from extproc.store.exchange import STORE_ERRORS

log = logging.getLogger("sluice.store")

KEEP_AFTER_S = 2 * 86400.0  # a period's count outlives the period this long (late settles)


def _n(x: Any) -> int:
    return int(float(x.decode() if isinstance(x, bytes) else x))


def _most(a: Amount, b: Amount) -> Amount:
    return Amount(max(a.tokens, b.tokens), max(a.nanos, b.nanos))


class _Book:
    """This replica's part of one tenant's period, and what it last heard of the whole."""

    __slots__ = ("tenant", "key", "budget", "span", "seq", "s", "o", "cs", "gen", "seen", "anchor",
                 "lease", "lease_used", "lease_until", "waiters", "inflight", "dirty", "share", "touched")

    def __init__(self, tenant: str, key: str, budget: Budget, span: Span) -> None:
        self.tenant, self.key, self.budget, self.span = tenant, key, budget, span
        self.seq = 0
        self.s = ZERO  # settled here in this period (cumulative)
        self.o = ZERO  # reserved here, in flight
        self.cs = ZERO  # ``s`` as of the last answer
        self.gen = ""  # the count's generation as of the last answer
        self.seen = ZERO  # the period's settled total as of the last answer
        self.anchor: Amount | None = None  # committed at the last answer, less this replica's own part
        self.lease = ZERO
        self.lease_used = ZERO
        self.lease_until = 0.0
        self.waiters: list[tuple[Amount, asyncio.Future[bool | None]]] = []
        self.inflight: asyncio.Task[None] | None = None
        self.dirty = False
        self.share: Amount | None = None  # the local share left while Redis is unreachable
        self.touched = 0.0

    @property
    def used(self) -> Amount:
        """Spent and reserved by everyone, as far as this replica knows."""
        base = self.anchor if self.anchor is not None else ZERO
        return base.plus(self.s).plus(self.o)

    def lease_fits(self, cost: Amount, now: float) -> bool:
        if now >= self.lease_until:
            return False
        b = self.budget
        return ((b.tokens is None or self.lease_used.tokens + cost.tokens <= self.lease.tokens)
                and (b.cost_nanos is None or self.lease_used.nanos + cost.nanos <= self.lease.nanos))


class RedisBudgets:
    """Budget books in Redis, shared by every replica (``gateway.state: redis://...``)."""

    shared = True

    def __init__(self, state: Any, *, currency: str = "USD", lease_ttl_s: float = 5.0,
                 slice_fraction: float = 0.05, fail_closed: bool = False, wait_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # ``state``: the RedisState whose client, registry and breaker these budgets share.
        self.state, self.currency = state, currency
        self.client, self.prefix = state.client, state.prefix
        self.lease_ttl_s, self.slice_fraction = lease_ttl_s, slice_fraction
        self.fail_closed, self.clock = fail_closed, clock
        self.wait_s = wait_s  # an exchange unanswered this long trips the store's breaker
        self.holder = f"{state.registry.replica_id}/{secrets.token_hex(6)}"  # this process, stable across fences
        self._script = self.client.register_script(BUDGET_EXCHANGE)
        self._books: dict[tuple[str, str], _Book] = {}
        self._seeds: dict[tuple[str, str], Amount] = {}
        self.ledgers = BudgetLedgers()
        self.exchanges = 0  # round trips that carried a request (for the bench)
        self._closing = False
        # Settles and local admissions go out with the store's own flush (its flush_s).
        state.flushers.append(lambda: self.sync(only_due=True))
        self._loaded = False

    # -- the budget seam -------------------------------------------------------------
    def admit(self, tenant: str, budget: Budget, cost: Amount, wall: float,
              force: bool = False) -> BudgetVerdict | Awaitable[BudgetVerdict]:
        self.state.start()  # its background task sends what this admits and settles
        book = self._book(tenant, budget, wall)
        now = self.clock()
        book.touched = now
        if force:
            return self._reserved(book, cost)  # shadow mode: counted, sent with the next exchange
        if budget.exceeds(cost):
            return refusal(self._view(book), cost, wall, self.currency)
        if book.lease_fits(cost, now):
            book.lease_used = book.lease_used.plus(cost)
            return self._reserved(book, cost)
        if not self.state.up:
            return self._from_share(book, cost, wall)
        return self._remote(book, cost, wall)

    def settle(self, hold: BudgetHold, actual: Amount, wall: float) -> None:
        self.ledgers.settle_once(hold, actual)
        book = self._books.get((hold.tenant, hold.key))
        if book is not None:
            book.o = book.o.minus(hold.cost)
            book.s = book.s.plus(actual)
            book.dirty = True  # sent with the store's next flush

    def view(self, tenant: str, budget: Budget, wall: float) -> BudgetView:
        span = budget.span(wall)
        book = self._books.get((tenant, budget.key(span)))
        return BudgetView(budget, span, book.used if book is not None else ZERO)

    def seed(self, tenant: str, key: str, settled: Amount) -> None:
        """The console's durable copy of a period's settled spend: used if Redis lost the count."""
        self._seeds[(tenant, key)] = _most(self._seeds.get((tenant, key), ZERO), settled)

    def forget(self, keep: set[str]) -> None:
        for k, book in list(self._books.items()):
            if k[0] not in keep and book.o == ZERO and not book.dirty and book.inflight is None:
                del self._books[k]

    def report(self, wall: float) -> list[dict[str, Any]]:
        """Every current or unsettled period, with the settled total as Redis last said
        (plus this replica's settles since), for the console's durable copy."""
        out = []
        for (tenant, key), b in self._books.items():
            if b.span.end > wall or b.o != ZERO:
                settled = b.seen.plus(b.s).minus(b.cs)
                out.append(period_row(tenant, key, b.span, settled, b.used))
        return out

    def snapshot(self, wall: float) -> dict[str, Any]:
        return {"kind": "redis", "up": self.state.up, "holder": self.holder, "exchanges": self.exchanges,
                "ledgers": self.ledgers.snapshot(), "periods": self.report(wall)}

    # -- local pieces ---------------------------------------------------------------
    def _book(self, tenant: str, budget: Budget, wall: float) -> _Book:
        span = budget.span(wall)
        key = budget.key(span)
        book = self._books.get((tenant, key))
        if book is None:
            book = self._books[(tenant, key)] = _Book(tenant, key, budget, span)
        book.budget = budget
        return book

    def _view(self, book: _Book) -> BudgetView:
        return BudgetView(book.budget, book.span, book.used)

    def _reserved(self, book: _Book, cost: Amount) -> BudgetVerdict:
        book.o = book.o.plus(cost)
        book.dirty = True
        self.ledgers.reserved(cost)
        return BudgetVerdict(True, self._view(book), BudgetHold(book.tenant, book.key, cost))

    def _from_share(self, book: _Book, cost: Amount, wall: float) -> BudgetVerdict:
        """Redis unreachable, the lease spent or expired: a local share, or refuse."""
        view = self._view(book)
        if self.fail_closed:
            return BudgetVerdict(False, view, reason=Reason.STATE_STORE_DOWN, retry_after_s=1.0,
                                 message="The shared budget store is unreachable; retry shortly.")
        if book.share is None:
            # Half of the room this replica last saw, split over the replicas it last saw:
            # the others take theirs from their own (older or newer) views.
            n = max(1, self.state.registry.most_seen(self.clock()) or 1)
            room = book.budget.remaining(view.used)
            book.share = Amount(room.tokens // (2 * n), room.nanos // (2 * n))
        share, b = book.share, book.budget
        if (b.tokens is not None and cost.tokens > share.tokens) or (b.cost_nanos is not None
                                                                       and cost.nanos > share.nanos):
            return refusal(view, cost, wall, self.currency)
        book.share = share.minus(cost)
        return self._reserved(book, cost)

    def _remote(self, book: _Book, cost: Amount, wall: float) -> Awaitable[BudgetVerdict]:
        fut: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        book.waiters.append((cost, fut))
        if book.inflight is None:
            self._begin(book)
        return self._await(book, cost, fut, wall)

    async def _await(self, book: _Book, cost: Amount, fut: asyncio.Future[bool | None],
                     wall: float) -> BudgetVerdict:
        got = await fut
        if got is None:  # the exchange failed: the store is down now
            return self._from_share(book, cost, wall)
        if got:
            self.ledgers.reserved(cost)
            return BudgetVerdict(True, self._view(book), BudgetHold(book.tenant, book.key, cost))
        return refusal(self._view(book), cost, wall, self.currency)

    # -- the exchange -----------------------------------------------------------------
    def _args(self, book: _Book, costs: list[Amount], want: bool) -> list[str]:
        b, lim = book.budget, book.budget.limit()
        seed = self._seeds.get((book.tenant, book.key), ZERO)
        view = book.seen if book.gen else ZERO
        cap_t = max(1, int((b.tokens or 0) * self.slice_fraction))
        cap_c = max(1, int((b.cost_nanos or 0) * self.slice_fraction))
        live = self.state.registry.live
        nums = (book.seq, lim.tokens, lim.nanos, book.s.tokens, book.s.nanos, book.o.tokens, book.o.nanos,
                book.cs.tokens, book.cs.nanos, view.tokens, view.nanos, seed.tokens, seed.nanos, cap_t, cap_c,
                live, self.lease_ttl_s, 1 if want and self.slice_fraction > 0 else 0, book.span.end + KEEP_AFTER_S)
        return [self.holder, "", " ".join(map(repr, nums)), book.gen,
                " ".join(f"{c.tokens}:{c.nanos}" for c in costs)]

    def _key(self, book: _Book) -> str:
        return f"{self.prefix}:bud:{book.tenant}:{book.key}"

    def _begin(self, book: _Book) -> None:
        """Send one exchange carrying every request of this book waiting now; the lease goes back."""
        waiters, book.waiters = book.waiters, []
        book.seq += 1
        want = self.clock() - book.touched < self.lease_ttl_s and not self._closing
        args = self._args(book, [c for c, _ in waiters], want)
        sent = (book.s, book.o)
        book.lease, book.lease_used, book.lease_until = ZERO, ZERO, 0.0
        book.dirty = False
        if waiters:
            self.exchanges += 1
        book.inflight = asyncio.get_running_loop().create_task(self._exchange(book, args, waiters, sent))

    async def _exchange(self, book: _Book, args: list[str], waiters: list[tuple[Amount, Any]],
                        sent: tuple[Amount, Amount]) -> None:
        sent_at = self.clock()
        loop = asyncio.get_running_loop()
        try:
            if not self._loaded:  # so that no request waits for Redis to compile the script
                await self.client.script_load(BUDGET_EXCHANGE)
                self._loaded = True
        except STORE_ERRORS as exc:
            book.inflight, book.dirty = None, True
            self.state.trip(f"budget script: {type(exc).__name__}: {exc}")
            self._release(book, waiters)
            return
        # A watchdog, not a timeout on the call: a late answer is still applied (what it
        # admitted for a request that fell back meanwhile goes back at once, below).
        due = loop.time() + self.wait_s
        watchdog = loop.call_at(due, self._overdue, book, waiters, due, loop)
        try:
            reply = await self._script(keys=[self._key(book)], args=args)
        except STORE_ERRORS as exc:
            book.inflight, book.dirty = None, True
            self.state.trip(f"budget exchange: {type(exc).__name__}: {exc}")
            self._release(book, waiters)
            return
        except asyncio.CancelledError:
            book.inflight = None
            self._release(book, waiters)
            raise
        finally:
            watchdog.cancel()
        book.inflight = None
        self.state.answered()
        self._apply(book, reply, waiters, sent, sent_at)
        if book.waiters and self.state.up:
            self._begin(book)

    def _overdue(self, book: _Book, waiters: list[tuple[Amount, Any]], due: float,
                 loop: asyncio.AbstractEventLoop, rechecked: bool = False) -> None:
        if not rechecked and loop.time() - due > self.wait_s / 4:
            # This loop was busy, not Redis slow: the answer may be read and not yet handled.
            again = loop.time() + self.wait_s / 2
            loop.call_at(again, self._overdue, book, waiters, again, loop, True)
            return
        if book.inflight is None:
            return  # answered meanwhile
        self.state.trip(f"budget exchange: no answer within {self.wait_s * 1000:.0f} ms")
        self._release(book, waiters)

    def _apply(self, book: _Book, reply: list[Any], waiters: list[tuple[Amount, Any]],
               sent: tuple[Amount, Amount], sent_at: float) -> None:
        gen = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        settled = Amount(_n(reply[1]), _n(reply[2]))
        committed = Amount(_n(reply[3]), _n(reply[4]))
        stale = (reply[7].decode() if isinstance(reply[7], bytes) else str(reply[7])) == "stale"
        flags = reply[8].decode() if isinstance(reply[8], bytes) else str(reply[8])
        if stale:  # an older exchange than one already applied: it changed nothing
            self._release(book, waiters)
            return
        admitted = ZERO
        for i, (cost, fut) in enumerate(waiters):
            ok = i < len(flags) and flags[i] == "1"
            if ok:
                admitted = admitted.plus(cost)
                book.o = book.o.plus(cost)  # Redis counts it in flight here now
                if fut.done():
                    # The request stopped waiting (it left, or fell back): released at once.
                    book.o = book.o.minus(cost)
                    book.dirty = True
                    continue
            if not fut.done():
                fut.set_result(ok)
        book.gen, book.seen, book.cs, book.share = gen, settled, sent[0], None
        lease = Amount(_n(reply[5]), _n(reply[6]))
        if lease != ZERO:
            book.lease, book.lease_used = lease, ZERO
            book.lease_until = sent_at + self.lease_ttl_s * 0.9  # Redis's deadline is later
        # What everyone else committed, as of this answer: this replica's own part changes locally.
        book.anchor = committed.minus(sent[0].plus(sent[1]).plus(admitted).plus(lease))

    def _release(self, book: _Book, carried: list[tuple[Amount, Any]]) -> None:
        waiting, book.waiters = book.waiters, []
        for _, fut in [*carried, *waiting]:
            if not fut.done():
                fut.set_result(None)

    # -- sending ------------------------------------------------------------------------
    async def sync(self, only_due: bool = False) -> None:
        """One exchange for each book with something to send (every book: ``only_due`` False)."""
        wall, tasks = time.time(), []
        for k, book in list(self._books.items()):
            if book.inflight is None and (book.dirty or book.waiters or not only_due):
                self._begin(book)
            if book.inflight is not None:
                tasks.append(book.inflight)
            elif book.span.end + KEEP_AFTER_S < wall and book.o == ZERO and not book.dirty:
                del self._books[k]
        if tasks:
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Send what is unsent (leases expire by themselves within their ttl)."""
        self._closing = True
        if self.state.up:
            with contextlib.suppress(*STORE_ERRORS):
                await self.sync(only_due=True)

    def close(self) -> None:
        """At shutdown, without an event loop: the settles not yet sent, through a blocking
        client (else their reservations would stay counted as spent for the period)."""
        self._closing = True
        url = getattr(self.state, "url", None)
        dirty = [b for b in self._books.values() if b.dirty and b.inflight is None]
        if url is None or not dirty:
            return
        try:
            c = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
            script = c.register_script(BUDGET_EXCHANGE)
            for book in dirty:
                book.seq += 1
                script(keys=[self._key(book)], args=self._args(book, [], want=False))
            c.close()
        except (redis.RedisError, OSError) as exc:
            log.warning("budgets: settles not sent at shutdown (%s); their reservations stay counted", exc)
