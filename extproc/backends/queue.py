"""The wait queue of one backend: a future per waiting request, the pump, the deadlines.

``extproc.policy.admission_queue`` orders and bounds the waiting requests (pure, takes
``now``); ``BackendQueue``, held by each ``BackendState``, parks an asyncio future per waiter, hands freed
capacity to waiters (``pump``, with the pool's look-ahead), and expires waiters whose
deadline (the time they were queued + the tier's ``max_queue_wait_ms``, both on the
runtime's clock) has passed, on the periodic ``tick`` (``extproc.service.ticker``). A future
ends with a ``Hold`` (admitted), a ``Denied`` (refused while waiting) or ``Expired``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from extproc.backends.endpoints import EndpointSet
from extproc.backends.hold import Hold
from extproc.policy import admit
from extproc.policy import kv as kvmath
from extproc.policy.admission_queue import AdmissionQueue, Enqueued, TierQueueConfig
from extproc.policy.owed import LOOK_AHEAD
from extproc.policy.reasons import Cause
from extproc.policy.schema import Policy
from extproc.policy.slots import Denied
from extproc.policy.view import BackendView

_ids = itertools.count(1)


@dataclass(frozen=True)
class Expired:
    """A waiter's deadline passed before capacity came: the client gets a 503 ``queue_timeout``."""

    waited_s: float


@dataclass
class Waiter:
    id: int
    tier: str
    tenant: str
    tenant_cap: int | None
    kv: int
    future: asyncio.Future[Hold | Denied | Expired]
    prefix: tuple[int, ...] = ()  # prompt prefix keys for placement (extproc.openai_api.prefix_key)
    queued_at: float = 0.0  # on the runtime's clock; the deadline is this + the tier's max wait
    work: float = 0.0  # its fair-share work (extproc.policy.fair_share.work)


def queue_configs(policy: Policy) -> dict[str, TierQueueConfig]:
    return {name: TierQueueConfig(max_depth=t.max_queue_depth, max_wait_s=t.max_queue_wait_ms / 1000.0,
                                  weight=float(t.queue_weight), priority=t.priority)
            for name, t in policy.tiers.items()}


def _held(got: Hold | Denied | Expired) -> bool:
    return not isinstance(got, Denied | Expired)


class Backend(BackendView, Protocol):
    """What the queue needs of the backend it waits for (``BackendState``)."""

    @property
    def endpoints(self) -> EndpointSet | None: ...

    def take(self, tier: str, tenant: str, cap: int | None, kv: int, now: float,
             prefix: tuple[int, ...] = (), behind_head: bool = False) -> Hold | Denied:
        """A slot and room for ``kv`` now, placed (and held), or why not."""
        ...

    def give_back(self, hold: Hold) -> None: ...

    def under_share(self, tier: str, tenant: str, now: float) -> bool:
        """Whether ``tenant`` holds less than its fair share of the budget in ``tier``."""
        ...

    def waiting_changed(self, tier: str, tenant: str, kv: int, now: float) -> None:
        """``kv`` more (or, negative, fewer) tokens of ``tenant`` wait: its demand changed."""
        ...

    def reclaim(self, now: float) -> int:
        """Take KV room back for waiters that may (extproc.backends.state); the tokens freeing."""
        ...


class BackendQueue:
    """The waiting requests of one backend, in its tiers' fair order."""

    def __init__(self, backend: Backend, policy: Policy) -> None:
        self.backend = backend
        self.configs = queue_configs(policy)
        self.order: AdmissionQueue[int] = AdmissionQueue(self.configs)
        self.waiters: dict[int, Waiter] = {}
        self.on_enqueue: Callable[[], None] | None = None  # wakes an idle ticker (extproc.service.ticker)

    # -- what the core reads (BackendView) ------------------------------------------------
    def waiting(self) -> Sequence[tuple[str, int]]:
        if not self.waiters:
            return ()
        return [(w.tier, w.kv) for w in self.waiters.values() if not w.future.done()]

    def queued(self, tier: str) -> int:
        return self.order.depth(tier)

    def depth(self, tier: str | None = None) -> int:
        return self.order.depth(tier)

    def retry_after_hint(self, tier: str, now: float) -> float:
        return self.order.retry_after_hint(tier, now)

    def owed_endpoints(self, tier: str | None, now: float, behind_head: bool = False) -> tuple[str, ...]:
        """The pool endpoints a request of ``tier`` may not take: owed to a blocked, more
        important waiter, and to its own tier's head when it goes past it (extproc.policy.owed)."""
        eps = self.backend.endpoints
        if eps is None or tier is None or not self.waiters:
            return ()
        heads = {t: w.kv for t in self.configs if (w := self._head(t)) is not None}
        return eps.owed(heads, self.backend.priorities, tier, now, behind_head)

    def head(self, tier: str) -> Waiter | None:
        return self._head(tier)

    def _head(self, tier: str) -> Waiter | None:
        """The next waiter of ``tier``'s queue (the least-served tenant's first), if it still
        waits."""
        wid = self.order.head(tier)
        w = None if wid is None else self.waiters.get(wid)
        return w if w is not None and not w.future.done() else None

    def _behind_head(self, tier: str, ids: list[int], now: float) -> int | None:
        """Look-ahead: a request behind ``tier``'s head that may go first because the head fits
        no endpoint now and it fits one not owed to the head (extproc.policy.owed), or because
        the head's tenant is over its fair share and the request's is not
        (extproc.policy.fair_share)."""
        head = self._head(tier)
        if head is None:
            return None
        be, eps = self.backend, self.backend.endpoints
        if eps is None or not kvmath.kv_fits(be, head.kv, now, tier):
            # no pool, or the head waits for the budget
            return self._under_share_past(tier, head, ids, now)
        if eps.fits_somewhere(head.kv, now, self.owed_endpoints(tier, now)):
            return None  # it fits: it waits for a slot, and so would the others
        exclude = self.owed_endpoints(tier, now, behind_head=True)
        scale = be.slot_scale(now)
        for wid in ids:
            w = self.waiters.get(wid)
            if w is None or w.future.done() or w.kv >= head.kv:
                continue
            if kvmath.kv_fits(be, w.kv, now, tier) and eps.fits_somewhere(w.kv, now, exclude) \
                    and not isinstance(be.slot_for(tier, w.tenant, w.tenant_cap, scale), Denied):
                return wid
        return None

    def _under_share_past(self, tier: str, head: Waiter, ids: list[int], now: float) -> int | None:
        """A request of a tenant under its fair share that fits now, past the head of a tenant over
        its share that does not."""
        be = self.backend
        if be.under_share(tier, head.tenant, now):
            return None
        scale = be.slot_scale(now)
        for wid in ids:
            w = self.waiters.get(wid)
            if (
                w is None
                or w.future.done()
                or w.tenant == head.tenant
                or not be.under_share(tier, w.tenant, now)
            ):
                continue
            if (
                kvmath.kv_fits(be, w.kv, now, tier, w.tenant)
                and be.fits_somewhere(w.kv, now, tier)
                and not isinstance(be.slot_for(tier, w.tenant, w.tenant_cap, scale), Denied)
            ):
                return wid
        return None

    # -- waiting --------------------------------------------------------------------------
    def can_admit(self, tier: str, now: float) -> bool:
        head = self._head(tier)
        return admit.can_admit(self.backend, tier, None if head is None else head.kv, now,
                               None if head is None else head.tenant)

    def enqueue(
        self,
        tier: str,
        tenant: str,
        cap: int | None,
        kv: int,
        now: float,
        prefix: tuple[int, ...] = (),
        work: float = 0.0,
    ) -> Waiter | str:
        """Queue a request; ``work`` (extproc.policy.fair_share.work) orders it among its tier's
        tenants."""
        wid = next(_ids)
        res = self.order.enqueue(wid, tier, now, tenant, work)
        if not isinstance(res, Enqueued):
            return res.reason
        fut: asyncio.Future[Hold | Denied | Expired] = asyncio.get_running_loop().create_future()
        w = self.waiters[wid] = Waiter(wid, tier, tenant, cap, kv, fut, prefix, now, work)
        self.backend.waiting_changed(tier, tenant, kv, now)
        if self.on_enqueue is not None:
            self.on_enqueue()
        return w

    def leave(self, w: Waiter) -> None:
        """A waiter gives up (expired or disconnected); a grant already handed over goes back."""
        self.order.remove(w.id)
        if self.waiters.pop(w.id, None) is not None:
            self.backend.waiting_changed(w.tier, w.tenant, -w.kv, 0.0)
        if w.future.done() and not w.future.cancelled():
            got = w.future.result()
            if _held(got):
                self.backend.give_back(cast("Hold", got))
        elif not w.future.done():
            w.future.cancel()

    def pump(self, now: float) -> int:
        """Hand free slots to waiting requests, fairly across tiers. Returns how many."""
        handed = 0
        passed: list[int] = []  # what look-ahead admitted past its tier's head

        def behind(tier: str, ids: list[int]) -> int | None:
            wid = self._behind_head(tier, ids, now)
            if wid is not None:
                passed.append(wid)
            return wid

        while self.order.depth():
            wid = self.order.next_eligible(
                lambda tier: self.can_admit(tier, now), now, behind, LOOK_AHEAD
            )
            if wid is None:
                break
            past = wid in passed  # the head keeps its owed endpoint against it
            passed.clear()
            w = self.waiters.get(wid)
            if w is None or w.future.done():
                continue
            got = self.backend.take(w.tier, w.tenant, w.tenant_cap, w.kv, now, w.prefix, past)
            if _held(got):
                self.order.charge(w.tier, w.tenant, w.work, now)
            self._resolve(w, got)
            handed += 1
        return handed

    def expire(self, now: float) -> int:
        """End the waits whose deadline has come (``Expired``), earliest first. Returns how many."""
        gone = 0
        for wid in self.order.expire(now):
            w = self.waiters.get(wid)
            if w is not None:
                self._resolve(w, Expired(now - w.queued_at))
                gone += 1
        return gone

    def tick(self, now: float) -> int:
        """The periodic step (``extproc.service.ticker``): expire the waits past their deadline, then
        hand capacity that came back over time (a watermark recovering, a latency limit
        rising) to the waiting requests. Returns how many were handed a slot."""
        if not self.order.depth():
            return 0
        self.expire(now)
        handed = self.pump(now)
        if self.waiters:
            self.backend.reclaim(now)
        return handed

    def _resolve(self, w: Waiter, got: Hold | Denied | Expired) -> None:
        if self.waiters.pop(w.id, None) is not None:
            self.backend.waiting_changed(w.tier, w.tenant, -w.kv, 0.0)
        self.order.remove(w.id)
        if w.future.done():
            if _held(got):
                self.backend.give_back(cast("Hold", got))
            return
        w.future.set_result(got)

    def reconfigure(self, policy: Policy) -> None:
        """The tiers' queue settings changed: rebuild the order, keep the waiters."""
        configs = queue_configs(policy)
        if configs == self.configs:
            return
        # Waiters keep waiting on their futures; only the queue's bookkeeping is rebuilt.
        # Each keeps the time it was queued at (its deadline moves only by the new max wait).
        self.configs = configs
        new: AdmissionQueue[int] = AdmissionQueue(configs)
        new.keep_counters(self.order)
        for w in sorted(self.waiters.values(), key=lambda w: w.id):
            if w.tier not in policy.tiers or not isinstance(
                new.enqueue(w.id, w.tier, w.queued_at, w.tenant, w.work), Enqueued
            ):
                self._resolve(w, Denied(Cause.QUEUE_REMOVED, "tier removed or queue shrank"))
        self.order = new
