"""Admission: from a parsed request to a ticket, or a refusal. One per stream, one entry point.

``admit()`` runs the whole sequence, cheapest refusal first: count the prompt (fairly,
stopping past the context window) → the completion budget (400 when it cannot fit) →
breakers and the degradation ladder (``route``) → the completion reservation (learned
or ``max_tokens``) → the budget's pre-charge (its worst case: n × the enforced
``max_tokens``, priced), beside → the RPM/TPM pre-charge → a concurrency slot and KV room,
or a wait in the fair queue (``SlotWait``). It yields ``Wait`` while the request must wait (the adapter
tells Envoy to wait longer) and the ``Ticket`` last; a refusal is a ``Refusal`` raised.
A rule in shadow mode runs, is counted as what it would have done, and lets the
request through: ``_unless_shadowed`` is where that is decided.

What the request holds is reported to the stream's ``Settlement`` as soon as it holds it,
so every exit from here on (a refusal, the client leaving) gives it back.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from extproc.backends.hold import Hold
from extproc.backends.queue import Expired, Waiter
from extproc.openai_api.body import ParsedRequest
from extproc.openai_api.errors import ratelimit_headers, retry_after_headers
from extproc.openai_api.prefix_key import prefix_keys
from extproc.policy import decision, ladder
from extproc.policy import kv as kvmath
from extproc.policy.admit import SlotRequest
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.context import completion_budget, input_too_long
from extproc.policy.fair_share import work
from extproc.policy.gate import Verdict
from extproc.policy.reasons import Reason
from extproc.policy.schema import Backend, Limits, Model, Policy, Tenant, Tier
from extproc.request import observe
from extproc.request.budget_charge import BudgetCharge
from extproc.request.refusal import Refusal
from extproc.request.settle import Settlement
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime
from extproc.tokens.counter import TokenizerFailed, estimate
from extproc.wire.peer import PeerStream

__all__ = ["BACKSTOP_S", "LEASE_WAIT_HINT_S", "Admission", "SlotWait", "Wait", "route"]

LEASE_WAIT_HINT_S = 2.0  # Envoy's message timeout while the lease check runs (bounded at 0.5 s, runtime)
BACKSTOP_S = 1.0  # past a queue deadline, a wait ends by itself if no tick ended it (_await_grant)
PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "embeddings": "input"}
# The shadow rule each refusal reason belongs to (policy ``shadow``): a shadowed rule counts
# what it would have refused and lets the request through.
SHADOW_RULE = {Reason.RPM: "rpm", Reason.TPM: "tpm", Reason.TPM_REQUEST_TOO_LARGE: "tpm",
               Reason.SLOTS: "slots", Reason.QUEUE_FULL: "queue", Reason.QUEUE_TIMEOUT: "queue",
               Reason.BUDGET: "budget", Reason.BUDGET_REQUEST_TOO_LARGE: "budget"}


@dataclass(frozen=True, slots=True)
class Wait:
    """The request waits (a queue, a lease check): Envoy must wait up to ``seconds`` for it."""

    seconds: float


class Admission:
    def __init__(self, rt: Runtime, policy: Policy, tenant: Tenant, limits: Limits, peer: PeerStream,
                 settlement: Settlement) -> None:
        self.rt, self.policy, self.tenant, self.limits, self.peer = rt, policy, tenant, limits, peer
        self.settlement = settlement
        self.tier = policy.tiers[tenant.tier]
        budget = policy.budget(tenant)
        self.budget = None if budget is None else BudgetCharge(rt, policy, tenant, budget, settlement,
                                                               self._unless_shadowed)

    def _unless_shadowed(self, reason: Reason, count: bool = True) -> bool:
        """True when ``reason``'s rule is shadowed for this tier: counted (``count``), not refused."""
        rule = SHADOW_RULE.get(reason)
        if rule is None or not self.policy.shadowed(self.tier.name, rule):
            return False
        if count:
            self.rt.metrics.shadowed(rule, self.tier.name)
        return True

    # -- before the body ---------------------------------------------------------------------
    def precheck(self, now: float) -> None:
        """Refuse a tenant that cannot pay for one token now, before its body is read or tokenized.
        Shadowed, it goes on unrecorded: the charge decides and records it once."""
        if self.budget is not None:
            self.budget.precheck()
        v = self.rt.state.peek(self.tenant.name, self.limits, 1, now)
        if v.admitted:
            return
        assert v.reason is not None
        if self._unless_shadowed(v.reason, count=False):
            return
        message = v.message if v.reason is Reason.RPM else (
            f"Rate limit reached: {self.limits.tpm} tokens per minute, and this key's token budget is spent "
            "(prompts refused after counting are charged too).")
        raise self._rate_refusal(v, message)

    def _rate_refusal(self, v: Verdict, message: str) -> Refusal:
        assert v.reason is not None
        extra = ratelimit_headers(v.tokens, v.requests)
        if math.isfinite(v.retry_after_s):
            extra.update(retry_after_headers(v.retry_after_s))
        code = "service_unavailable" if v.reason is Reason.STATE_STORE_DOWN else "rate_limit_exceeded"
        return Refusal(v.reason, message, code=code, headers=extra)

    # -- the sequence --------------------------------------------------------------------------
    async def admit(self, req: ParsedRequest, backend: Backend, model: Model) -> AsyncIterator[Wait | Ticket]:
        """Yields ``Wait`` while the request must wait, then its ``Ticket``; raises ``Refusal``."""
        prompt, exact = await self._count_prompt(req, model)
        self.settlement.counted(req, prompt, exact)
        completion = self._completion_budget(req, model, prompt, exact)
        now = self.rt.clock()
        ticket = route(self.rt, self.policy, self.tier, self.tenant.name, backend, model, completion, now)
        self.settlement.routed(ticket)
        placement = ticket.backend.placement
        if placement.prefix_affinity and ticket.backend.is_pool:
            ticket.prefix = prefix_keys(req, ticket.model.name, placement.prefix_block_bytes,
                                        placement.prefix_max_bytes)
        reserve = observe.completion_tokens(self.rt, ticket, self.tenant.name, self.tenant.tier)
        cost = prompt + req.n * reserve.tpm_completion
        if self.budget is not None:
            await self.budget.reserve(ticket, req, prompt)
        verdict = self._charge(ticket, cost, now)
        if not isinstance(verdict, Verdict):
            verdict = await verdict  # a shared store's lease was short: one round trip
        if not verdict.admitted:
            raise self._rate_refusal(verdict, verdict.message)
        self.settlement.precharged(cost)
        ticket.verdict = verdict
        ticket.kv = kvmath.footprint(prompt + req.n * reserve.kv_completion, ticket.backend_state.kv_block_size)
        ticket.work = work(prompt, req.n * reserve.kv_completion)
        slot = SlotWait(self.rt, self.tier, self.tenant.name, self.limits.max_concurrency, self.peer,
                        self._unless_shadowed)
        wait_s = slot.acquire(ticket, now)
        if wait_s is not None:
            yield Wait(wait_s)
            await slot.wait(ticket)
        ticket.admitted_at = self.rt.clock()
        self.rt.metrics.admitted(self.tenant.name, self.tenant.tier, cost, verdict.tokens.remaining, ticket.degraded)
        self.rt.track(self.tenant.name, +1)
        yield ticket

    async def _count_prompt(self, req: ParsedRequest, model: Model) -> tuple[int, bool]:
        """Prompt tokens, counted fairly across tenants; stops past the context window (the
        request is refused there whatever the exact number, so the work is bounded).

        Embeddings inputs are separate sequences: each is held to the window alone, all are
        counted (the body cap bounds how many there are), and the reservation is their sum."""
        window, separate = model.context_window, req.kind == "embeddings"
        limit = window if separate else max(0, window - req.fixed_tokens)
        too_long = next((i for i, n in req.id_inputs if n > window), None) if separate else None
        if too_long is not None:
            raise Refusal.of(input_too_long(too_long, window))
        if self.rt.token_pool.pending(self.tenant.name) >= self.limits.max_concurrency:
            raise Refusal.slots(f"limit {self.limits.max_concurrency}")
        try:
            count = await self.rt.count_prompt(model.encoding, req.texts, tenant=self.tenant.name,
                                               limit=limit, per_text=separate)
        except TokenizerFailed as exc:
            # Charged as counted (extproc.policy.reasons.CHARGED): the estimate, up to the window.
            tokens = min(req.fixed_tokens + estimate(req.texts), model.context_window + 1)
            self.settlement.counted(req, tokens, False)
            raise Refusal(Reason.TOKENIZER_FAILED, f"The prompt could not be tokenized: {exc}",
                          code="tokenizer_failed", param=PROMPT_PARAM.get(req.kind)) from None
        if count.over_text is not None:
            # What counting it cost, charged as a refusal (extproc.policy.reasons.CHARGED).
            self.settlement.counted(req, req.fixed_tokens + count.tokens, False)
            raise Refusal.of(input_too_long(req.text_inputs[count.over_text], window))
        return req.fixed_tokens + count.tokens, count.complete

    def _completion_budget(self, req: ParsedRequest, model: Model, prompt: int, exact: bool) -> int:
        """What to reserve (and enforce upstream) per generated completion (extproc.policy.context)."""
        got = completion_budget(prompt, req.max_tokens, req.n, model.context_window,
                                model.default_max_tokens or self.policy.gateway.default_max_tokens,
                                exact=exact, param="input" if req.kind == "responses" else "messages")
        if isinstance(got, decision.Reject):
            raise Refusal.of(got)
        return got

    def _charge(self, ticket: Ticket, cost: int, now: float) -> Verdict | Awaitable[Verdict]:
        """The RPM/TPM verdict, or (a shared store whose local lease is short) an awaitable of it."""
        scale = ticket.backend_state.scale(now)
        v = self.rt.state.admit(self.tenant.name, self.limits, cost, now, scale=scale)
        if isinstance(v, Verdict):
            return self._forced_if_shadowed(v, cost, now, scale)
        return self._charge_later(v, cost, now, scale)

    async def _charge_later(self, pending: Awaitable[Verdict], cost: int, now: float, scale: float) -> Verdict:
        return self._forced_if_shadowed(await pending, cost, now, scale)

    def _forced_if_shadowed(self, v: Verdict, cost: int, now: float, scale: float) -> Verdict:
        if v.admitted or v.reason is None or not self._unless_shadowed(v.reason):
            return v
        forced = self.rt.state.admit(self.tenant.name, self.limits, cost, now, scale=scale, force=True)
        assert isinstance(forced, Verdict)  # a forced charge never waits for a store
        return forced


# -- breakers and the degradation ladder: where the request goes ---------------------------
def route(rt: Runtime, policy: Policy, tier: Tier, tenant: str, backend: Backend, model: Model,
          completion: int, now: float) -> Ticket:
    """Ask the breakers, let the ladder decide, and build the ticket it says."""
    be = rt.backends[backend.name]
    verdict = be.breaker.allow(now)
    ticket = Ticket(backend, model, be, completion, tenant=tenant, breaker_verdict=verdict)
    route_refused = False
    route_breaker = be.route_breakers.get(model.name)
    if verdict.allowed and route_breaker is not None:
        ticket.route_verdict = route_verdict = route_breaker.allow(now)
        if not route_verdict.allowed:
            ticket.report_outcome(Outcome.CANCELLED, None, now)
            ticket.breaker_verdict, verdict, route_refused = None, route_verdict, True
    fb = _fallback(rt, policy, model, now) if model.fallback_model is not None else None
    shadowed = [r for r in ladder.RULES if policy.shadowed(tier.name, r)] \
        if tier.shadow or policy.gateway.shadow else ()
    tenant_verdict = None
    if ladder.asks_tenant(verdict, fb is not None, shadowed):
        if not verdict.allowed:  # shadowed: nothing to report back to the breakers
            ticket.breaker_verdict = ticket.route_verdict = None
        ticket.tenant_verdict = tenant_verdict = be.tenants_for(model.name).allow(tenant, now)
    got = ladder.decide(ladder.LadderInput(
        tier.name, backend.name, model.name, verdict, route_refused, tenant_verdict,
        None if fb is None else fb[1].context_window, kvmath.pressure_scale(be, tier.name, now), tier.degrade,
        completion, shadowed))
    if got is ladder.AS_ASKED:
        return ticket
    if isinstance(got, ladder.Fallback):
        ticket.report_outcome(Outcome.CANCELLED, None, now)
        assert fb is not None
        ticket, got = _to_fallback(rt, ticket, fb, got, now)
    for rule in got.shadowed:
        rt.metrics.shadowed(rule, tier.name)
    if isinstance(got, ladder.Refuse):
        ticket.report_outcome(Outcome.CANCELLED, None, now)
        raise Refusal(got.reason, got.message, code=got.code, headers=retry_after_headers(got.retry_after_s))
    if got.completion is not None:
        ticket.completion = got.completion
    ticket.degraded.extend(got.degraded)
    return ticket


def _fallback(rt: Runtime, policy: Policy, model: Model, now: float) -> tuple[Backend, Model] | None:
    if model.fallback_model is None:
        return None
    found = policy.by_model.get(model.fallback_model)
    if found is None:
        return None
    be = rt.backends[found[0].name]
    return found if be.breaker.state(now).value != "open" else None


def _to_fallback(rt: Runtime, ticket: Ticket, fb: tuple[Backend, Model], step: ladder.Fallback,
                 now: float) -> tuple[Ticket, ladder.Proceed | ladder.Refuse]:
    """The fallback's ticket, and the ladder's last word once its breakers were asked."""
    backend, model = fb
    be = rt.backends[backend.name]
    verdict = be.breaker.allow(now)
    if not verdict.allowed:
        return ticket, ladder.land(step, backend.name, verdict, None)
    ticket = Ticket(backend, model, be, step.completion, tenant=ticket.tenant, breaker_verdict=verdict)
    ticket.tenant_verdict = be.tenants_for(model.name).allow(ticket.tenant, now)
    return ticket, ladder.land(step, backend.name, verdict, ticket.tenant_verdict)


# -- a slot and KV room: taken now, or waited for ------------------------------------------
class SlotWait:
    def __init__(self, rt: Runtime, tier: Tier, tenant: str, cap: int | None, peer: PeerStream,
                 unless_shadowed: Callable[[Reason], bool]) -> None:
        self.rt, self.tier, self.tenant, self.cap, self.peer = rt, tier, tenant, cap, peer
        self.unless_shadowed = unless_shadowed

    def acquire(self, ticket: Ticket, now: float) -> float | None:
        """Take a slot (and ``ticket.kv`` of room) now: None; or how long Envoy must be told to
        wait for ``wait``; or raise the refusal."""
        be = ticket.backend_state
        tier = self.tier
        req = SlotRequest(tier.name, self.tenant, self.cap, ticket.kv,
                          may_queue=tier.max_queue_depth > 0 and tier.max_queue_wait_ms > 0,
                          work=ticket.work)
        got = be.acquire(req, now, ticket.prefix)
        if isinstance(got, Hold):
            ticket.hold = got
            return None
        if isinstance(got, decision.Queue):
            # Without it Envoy's own message_timeout would answer 504 before the queue's deadline.
            return tier.max_queue_wait_ms / 1000 + 2
        if be.lease_wait is not None and got.cause in decision.ROOM_CAUSES and ticket.lease_short is None:
            # Shared leases: the room may be in the pool but not yet in this replica's lease;
            # the refusal woke the lease task, so wait for that one check and try once more.
            ticket.lease_short = req
            ticket.lease_checked = be.lease_wait()  # now, before the hint is sent: see next_check
            return LEASE_WAIT_HINT_S
        return self._refused(got)

    def _refused(self, got: decision.Reject) -> None:
        if not self.unless_shadowed(got.reason):
            raise Refusal.of(got)
        return None

    async def wait(self, ticket: Ticket) -> None:
        """The wait ``acquire`` asked for: the lease check, or a place in the queue."""
        if ticket.lease_short is not None:
            return await self._await_lease(ticket)
        be = ticket.backend_state
        # Queued at t0: the deadline counts from here, not from the stream's ``now`` (taken
        # before a shared store's round trip and the wait hint's send).
        t0 = self.rt.clock()
        w = be.queue.enqueue(self.tier.name, self.tenant, self.cap, ticket.kv, t0, ticket.prefix,
                             ticket.work)
        if isinstance(w, str):
            if self.unless_shadowed(Reason.QUEUE_FULL):
                return
            raise Refusal(Reason.QUEUE_FULL, "Too many requests are waiting for this backend; retry later.",
                          code="rate_limit_exceeded",
                          headers=retry_after_headers(be.queue.retry_after_hint(self.tier.name, t0)))
        result = "cancelled"
        try:
            result = await self._await_grant(ticket, w)
        except Refusal as rej:
            result = str(rej.reason)
            raise
        finally:
            ticket.queued_s = self.rt.clock() - t0
            self.rt.metrics.queue_waited(self.tier.name, result, ticket.queued_s)

    async def _await_lease(self, ticket: Ticket) -> None:
        be, req, checked = ticket.backend_state, ticket.lease_short, ticket.lease_checked
        assert req is not None and checked is not None
        await checked
        got = be.acquire(req, self.rt.clock(), ticket.prefix)
        if isinstance(got, Hold):
            ticket.hold = got
            return
        assert isinstance(got, decision.Reject)  # a request that may not queue is never queued
        self._refused(got)

    async def _await_grant(self, ticket: Ticket, w: Waiter) -> str:
        """Wait for the queue's answer: a slot, a refusal, or the deadline, which the runtime's
        tick decides on the runtime's clock (``BackendQueue.tick``); or the client leaving."""
        be = ticket.backend_state
        max_wait = self.tier.max_queue_wait_ms / 1000
        closed = self.peer.closed_signal()
        try:
            # The timeout is only a backstop, should the tick loop (extproc.service.ticker) have
            # died: the wait still ends, as a queue_timeout, before Envoy's message timeout
            # (max wait + 2 s) answers 504. Normally the tick ends it at the deadline.
            done, _ = await asyncio.wait({w.future, closed}, timeout=max_wait + BACKSTOP_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            be.queue.leave(w)
            raise
        if w.future in done and not w.future.cancelled():
            got = w.future.result()
            if isinstance(got, Hold):
                ticket.hold = got
                return "admitted"
            if not isinstance(got, Expired):
                raise Refusal.slots(got.detail)
        be.queue.leave(w)
        if closed in done:
            raise Refusal(Reason.CLIENT_GONE, "client went away while queued")
        if self.unless_shadowed(Reason.QUEUE_TIMEOUT):
            return "shadowed"
        raise Refusal(Reason.QUEUE_TIMEOUT, f"Waited {max_wait:.0f}s for a free slot; the backend is saturated.",
                      code="service_unavailable",
                      headers=retry_after_headers(be.queue.retry_after_hint(self.tier.name, self.rt.clock())))
