"""The admission decision for one request, step by step, cheapest refusal first.

breaker -> degradation ladder -> RPM/TPM pre-charge -> concurrency slot (or a wait in
the fair queue). Each step either passes, degrades the request, or raises
``Reject``. A rule in shadow mode runs, records what it would have done, and lets
the request through. The decisions are the pure core's (``extproc.policy.ladder``
for breakers and degradation, ``extproc.policy.admit`` for the slot); this module
asks the breakers and the backend, and maps what the core decided to tickets,
``Reject`` and messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.backends.hold import Hold
from extproc.backends.queue import Expired, Waiter
from extproc.backends.state import BackendState
from extproc.openai_api.errors import retry_after_headers
from extproc.policy import decision, ladder
from extproc.policy import kv as kvmath
from extproc.policy.admit import SlotRequest
from extproc.policy.breaker import BreakerVerdict, Outcome
from extproc.policy.gate import Verdict
from extproc.policy.schema import Backend, Limits, Model, Policy, Tenant
from extproc.runtime.runtime import Runtime
from extproc.wire import messages as msg
from extproc.wire.peer import PeerStream

LEASE_WAIT_HINT_S = 2.0  # Envoy's message timeout while the lease check runs (bounded at 0.5 s, runtime)
BACKSTOP_S = 1.0  # past a queue deadline, a wait ends by itself if no tick ended it (_await_grant)


class Reject(Exception):
    def __init__(self, reason: str, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.reason, self.message, self.code, self.param = reason, message, code or reason, param
        self.headers = headers or {}

    @classmethod
    def of(cls, d: decision.Reject) -> Reject:
        """The exception a stream answers for the core's ``Reject`` decision."""
        headers = retry_after_headers(d.retry_after_s) if d.retry_after_s is not None else None
        return cls(d.reason, d.message, code=d.code, param=d.param, headers=headers)


@dataclass
class Ticket:
    """What an admitted request holds until it settles."""

    backend: Backend
    model: Model
    runtime: BackendState
    completion: int  # tokens reserved per generated completion
    degraded: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    hold: Hold | None = None
    kv: int = 0
    admitted_at: float = 0.0
    queued_s: float = 0.0
    breaker_verdict: BreakerVerdict | None = None
    route_verdict: BreakerVerdict | None = None  # the model route's own breaker, if it has one
    tenant: str = ""
    tenant_verdict: BreakerVerdict | None = None  # the tenant's breaker on this backend
    lease_short: SlotRequest | None = None  # refused for room in a shared lease: retried after one lease check
    prefix: tuple[int, ...] = ()  # prompt prefix keys when the pool has prefix affinity (extproc.openai_api.prefix_key)

    def report_outcome(self, outcome: Outcome, latency_s: float | None, now: float) -> None:
        """Tell each breaker that let this request through how it ended; once. The one place
        an outcome reaches the breakers: admission gives a probe back with ``CANCELLED``,
        settle reports ``outcome_at_settle`` (extproc.request.settle).

        The tenant's breakers hear first and decide who a failure is blamed on: a
        failure of this tenant alone reaches the backend's breakers as
        ``TENANT_FAILURE``, which they ignore. A request that will not be sent reports
        ``CANCELLED``: a half-open probe's place goes back.
        """
        be = self.runtime
        shared = outcome
        if self.tenant_verdict is not None:
            shared = be.tenants_for(self.model.name).record(self.tenant, outcome, now,
                                                            admitted=self.tenant_verdict.allowed)
        if self.hold is not None and self.hold.endpoint is not None and be.endpoints is not None:
            # The endpoint's own breaker ejects it from picking (extproc.backends.endpoints); a failure
            # of one endpoint while others are usable is not the pool's.
            shared = be.endpoints.record(self.hold.endpoint, shared, latency_s, now)
        if self.breaker_verdict is not None and self.breaker_verdict.allowed:
            be.breaker.record(shared, latency_s, now)
        rb = be.route_breakers.get(self.model.name)
        if rb is not None and self.route_verdict is not None and self.route_verdict.allowed:
            rb.record(shared, latency_s, now)
        self.breaker_verdict = self.route_verdict = self.tenant_verdict = None


class Admission:
    def __init__(self, rt: Runtime, policy: Policy, tenant: Tenant, limits: Limits, peer: PeerStream) -> None:
        self.rt, self.policy, self.tenant, self.limits, self.peer = rt, policy, tenant, limits, peer
        self.tier = policy.tiers[tenant.tier]

    def _shadow(self, rule: str) -> bool:
        if self.policy.shadowed(self.tier.name, rule):
            self.rt.metrics.shadowed(rule, self.tier.name)
            return True
        return False

    # -- breaker and degradation: pick where the request goes ------------------------
    def route(self, backend: Backend, model: Model, completion: int, now: float) -> Ticket:
        """Ask the breakers, let the ladder decide (``extproc.policy.ladder``), and build the
        ticket it says; a probe place asked for a request that will not be sent goes back."""
        be = self.rt.backends[backend.name]
        verdict = be.breaker.allow(now)
        ticket = Ticket(backend, model, be, completion, breaker_verdict=verdict, tenant=self.tenant.name)
        route_refused = False
        route_breaker = be.route_breakers.get(model.name)
        if verdict.allowed and route_breaker is not None:
            ticket.route_verdict = route_verdict = route_breaker.allow(now)
            if not route_verdict.allowed:
                ticket.report_outcome(Outcome.CANCELLED, None, now)  # a half-open probe's place goes back
                ticket.breaker_verdict, verdict, route_refused = None, route_verdict, True
        fb = self._fallback(model, now) if model.fallback_model is not None else None
        tier = self.tier
        shadowed = [r for r in ladder.RULES if self.policy.shadowed(tier.name, r)] \
            if tier.shadow or self.policy.gateway.shadow else ()
        tenant_verdict = None
        if ladder.asks_tenant(verdict, fb is not None, shadowed):
            if not verdict.allowed:  # shadowed: nothing to report back to the breakers
                ticket.breaker_verdict = ticket.route_verdict = None
            ticket.tenant_verdict = tenant_verdict = be.tenants_for(model.name).allow(ticket.tenant, now)
        got = ladder.decide(ladder.LadderInput(
            tier.name, backend.name, model.name, verdict, route_refused, tenant_verdict,
            None if fb is None else fb[1].context_window, kvmath.pressure_scale(be, tier.name, now), tier.degrade,
            completion, shadowed))
        if got is ladder.AS_ASKED:
            return ticket
        if isinstance(got, ladder.Fallback):
            ticket.report_outcome(Outcome.CANCELLED, None, now)  # a half-open probe's place goes back
            assert fb is not None
            ticket, got = self._to_fallback(ticket, fb, got, now)
        for rule in got.shadowed:
            self.rt.metrics.shadowed(rule, tier.name)
        if isinstance(got, ladder.Refuse):
            ticket.report_outcome(Outcome.CANCELLED, None, now)  # a half-open probe's place goes back
            raise Reject(got.reason, got.message, code=got.code, headers=retry_after_headers(got.retry_after_s))
        if got.completion is not None:
            ticket.completion = got.completion
        ticket.degraded.extend(got.degraded)
        return ticket

    def _fallback(self, model: Model, now: float) -> tuple[Backend, Model] | None:
        if model.fallback_model is None:
            return None
        found = self.policy.by_model.get(model.fallback_model)
        if found is None:
            return None
        be = self.rt.backends[found[0].name]
        return found if be.breaker.state(now).value != "open" else None

    def _to_fallback(self, ticket: Ticket, fb: tuple[Backend, Model], step: ladder.Fallback,
                     now: float) -> tuple[Ticket, ladder.Proceed | ladder.Refuse]:
        """The fallback's ticket, and the ladder's last word once its breakers were asked."""
        backend, model = fb
        be = self.rt.backends[backend.name]
        verdict = be.breaker.allow(now)
        if not verdict.allowed:
            return ticket, ladder.land(step, backend.name, verdict, None)
        ticket = Ticket(backend, model, be, step.completion, breaker_verdict=verdict, tenant=ticket.tenant)
        ticket.tenant_verdict = be.tenants_for(model.name).allow(ticket.tenant, now)
        return ticket, ladder.land(step, backend.name, verdict, ticket.tenant_verdict)

    # -- budgets -------------------------------------------------------------------
    def precheck(self, now: float) -> Verdict | None:
        """The refusal, if the tenant cannot pay for even one token now: before any parsing or tokenizing."""
        v = self.rt.state.peek(self.tenant.name, self.limits, 1, now)
        if v.admitted:
            return None
        assert v.reason is not None
        # Shadowed: let it through unrecorded; charge() decides and records it once.
        if self.policy.shadowed(self.tier.name, "rpm" if v.reason == "rpm" else "tpm"):
            return None
        return v

    def charge(self, ticket: Ticket, cost: int, now: float) -> Verdict | Awaitable[Verdict]:
        """The verdict, or (a shared store whose local lease is short) an awaitable of it."""
        scale = ticket.runtime.scale(now)
        v = self.rt.state.admit(self.tenant.name, self.limits, cost, now, scale=scale)
        if isinstance(v, Verdict):
            return self._unless_shadowed(v, cost, now, scale)
        return self._charge_later(v, cost, now, scale)

    async def _charge_later(self, pending: Awaitable[Verdict], cost: int, now: float, scale: float) -> Verdict:
        return self._unless_shadowed(await pending, cost, now, scale)

    def _unless_shadowed(self, v: Verdict, cost: int, now: float, scale: float) -> Verdict:
        if not v.admitted and v.reason in ("rpm", "tpm", "tpm_request_too_large"):
            rule = "rpm" if v.reason == "rpm" else "tpm"
            if not self._shadow(rule):
                return v
            forced = self.rt.state.admit(self.tenant.name, self.limits, cost, now, scale=scale, force=True)
            assert isinstance(forced, Verdict)  # a forced charge never waits for a store
            return forced
        return v

    # -- concurrency ---------------------------------------------------------------
    def acquire_slot(self, ticket: Ticket, cost: int, now: float,
                     kv_tokens: int | None = None) -> list[pb.ProcessingResponse]:
        """Take a slot (and KV room), or say the request must wait: returns the messages to send first.

        ``kv_tokens`` is what the KV footprint reserves when it differs from ``cost``
        (``kv_reservation: learned``). The decision is ``extproc.policy.admit.decide``'s."""
        be = ticket.runtime
        ticket.kv = kvmath.footprint(cost if kv_tokens is None else kv_tokens, be.kv_block_size)
        tier = self.tier
        req = SlotRequest(tier.name, self.tenant.name, self.limits.max_concurrency, ticket.kv,
                          may_queue=tier.max_queue_depth > 0 and tier.max_queue_wait_ms > 0)
        got = be.acquire(req, now, ticket.prefix)
        if isinstance(got, Hold):
            ticket.hold = got
            return []
        if isinstance(got, decision.Queue):
            return [self._wait_hint()]
        if be.lease_wait is not None and got.cause in decision.ROOM_CAUSES and ticket.lease_short is None:
            # Shared leases: the room may be in the pool but not yet in this replica's lease;
            # the refusal woke the lease task, so wait for that one check and try once more.
            ticket.lease_short = req
            return [pb.ProcessingResponse(override_message_timeout=msg.duration_from(LEASE_WAIT_HINT_S))]
        if got.reason == decision.Reason.SLOTS and self._shadow("slots"):
            return []
        raise Reject.of(got)

    async def _await_lease(self, ticket: Ticket) -> None:
        be, req = ticket.runtime, ticket.lease_short
        assert be.lease_wait is not None and req is not None
        await be.lease_wait()
        got = be.acquire(req, self.rt.clock(), ticket.prefix)
        if isinstance(got, Hold):
            ticket.hold = got
            return
        assert isinstance(got, decision.Reject)  # a request that may not queue is never queued
        if got.reason == decision.Reason.SLOTS and self._shadow("slots"):
            return
        raise Reject.of(got)

    def _wait_hint(self) -> pb.ProcessingResponse:
        # Without this Envoy's own message_timeout would answer 504 before our deadline.
        return pb.ProcessingResponse(override_message_timeout=msg.duration_from(self.tier.max_queue_wait_ms / 1000 + 2))

    async def wait_in_queue(self, ticket: Ticket, now: float) -> None:
        be = ticket.runtime
        if ticket.lease_short is not None:
            return await self._await_lease(ticket)
        # Queued at t0: the deadline counts from here, not from the stream's ``now`` (taken
        # before a shared store's round trip and the wait hint's send).
        t0 = self.rt.clock()
        w = be.enqueue(self.tier.name, self.tenant.name, self.limits.max_concurrency, ticket.kv, t0, ticket.prefix)
        if isinstance(w, str):
            if self._shadow("queue"):
                return
            raise Reject("queue_full", "Too many requests are waiting for this backend; retry later.",
                         code="rate_limit_exceeded",
                         headers=retry_after_headers(be.queue.retry_after_hint(self.tier.name, t0)))
        result = "cancelled"
        try:
            result = await self._await_grant(ticket, w)
        except Reject as rej:
            result = rej.reason
            raise
        finally:
            ticket.queued_s = self.rt.clock() - t0
            self.rt.metrics.queue_waited(self.tier.name, result, ticket.queued_s)

    async def _await_grant(self, ticket: Ticket, w: Waiter) -> str:
        """Wait for the queue's answer: a slot, a refusal, or the deadline, which the runtime's
        tick decides on the runtime's clock (``BackendState.tick``); or the client leaving."""
        be = ticket.runtime
        max_wait = self.tier.max_queue_wait_ms / 1000
        closed = self.peer.closed_signal()
        try:
            # The timeout is only a backstop, should the tick loop (extproc.service.ticker) have died:
            # the wait still ends, as a queue_timeout, before Envoy's message timeout
            # (_wait_hint: max wait + 2 s) answers 504. Normally the tick ends it at the deadline.
            done, _ = await asyncio.wait({w.future, closed}, timeout=max_wait + BACKSTOP_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            be.leave(w)
            raise
        if w.future in done and not w.future.cancelled():
            got = w.future.result()
            if isinstance(got, Hold):
                ticket.hold = got
                return "admitted"
            if not isinstance(got, Expired):
                raise Reject("slots", f"Too many concurrent requests for this key ({got.detail}).",
                             code="rate_limit_exceeded", headers=retry_after_headers(1))
        be.leave(w)
        if closed in done:
            raise Reject("client_gone", "client went away while queued")
        if self._shadow("queue"):
            return "shadowed"
        raise Reject("queue_timeout", f"Waited {max_wait:.0f}s for a free slot; the backend is saturated.",
                     code="service_unavailable",
                     headers=retry_after_headers(be.queue.retry_after_hint(self.tier.name, self.rt.clock())))
