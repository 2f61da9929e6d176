"""How a stream settles: the one exit that gives back what a request held, exactly once.

A ``Settlement`` is made per stream once the tenant is known. Admission tells it what the
request holds (``routed``, ``counted``, ``precharged``); the adapter tells it what the
response did (``forwarded``, ``responded``, ``watch``, ``usage_record``, or all of it at
once after the fact: ``settle_with``, from Envoy's access log under ``response_processing:
access_log``, ``extproc.request.outcome``); ``settle()`` runs on every way the stream ends
(under ``access_log``: when the request's entry arrives or its wait for one expires,
``extproc.request.log_settle``): it charges the tenant what the request used (the
usage the backend reported, Envoy's usage record, or an estimate) and refunds the rest
of the pre-charge, releases the slot and KV, reports the outcome to the breakers that
let it through, and feeds the latency observations. A prompt refused after it was
counted is charged as spent (``charge_refused``). A budget's reservation (``budgeted``)
settles to the same charge, priced, and the usage goes into the tenant's history.
"""

from __future__ import annotations

import logging

from extproc.envoy.usage_record import EnvoyUsage
from extproc.openai_api.body import ParsedRequest
from extproc.openai_api.usage import JSONTracker, SSETracker, Usage
from extproc.policy.breaker_outcome import outcome_at_settle
from extproc.policy.budget import ZERO, spend
from extproc.policy.budget_ledger import BudgetHold
from extproc.policy.charge import Basis, Charge, SettleFacts, charge
from extproc.policy.fair_share import work
from extproc.policy.reasons import CHARGED, Ending, Reason
from extproc.policy.schema import Limits, Tenant, Tier
from extproc.request import observe
from extproc.request.outcome import ResponseOutcome
from extproc.request.repick import served_elsewhere
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.stream")

__all__ = ["Settlement"]


class Settlement:
    def __init__(self, rt: Runtime, tenant: Tenant, limits: Limits, tier: Tier, arrived_s: float,
                 request_id: str = "") -> None:
        self.rt, self.tenant, self.limits, self.tier = rt, tenant, limits, tier
        self.arrived_s = arrived_s  # the stream starts with the request's headers
        # Envoy's x-request-id: the engine's record of the request has it too
        self.request_id = request_id
        self.req: ParsedRequest | None = None
        self.ticket: Ticket | None = None
        self.prompt_tokens = 0
        self.prompt_exact = True  # False: the count stopped past the context window
        self.reserved = 0  # pre-charged tokens: prompt + n × the completion reservation
        self.admitted = False  # tokens are pre-charged and must be settled
        self.sent_upstream = False  # the request went on to the backend
        self.settled = False
        self.status = 0
        self.first_byte_s: float | None = None
        self.ended_s: float | None = None  # when the response ended, if learned after the fact (the access log)
        self.sse = False
        self.tracker: SSETracker | JSONTracker | None = None
        self.envoy_usage: EnvoyUsage | None = None
        self.budget_hold: BudgetHold | None = None  # the budget's reservation, when the tenant has one

    # -- what admission and the adapter report --------------------------------------------
    def routed(self, ticket: Ticket) -> None:
        """A ticket exists: a half-open breaker may have let the request in as its probe."""
        self.ticket = ticket

    def counted(self, req: ParsedRequest, tokens: int, exact: bool) -> None:
        self.req, self.prompt_tokens, self.prompt_exact = req, tokens, exact

    def precharged(self, cost: int) -> None:
        self.admitted, self.reserved = True, cost

    def budgeted(self, hold: BudgetHold) -> None:
        """The budget's reservation: settled with the rest, priced with the served model's price."""
        self.budget_hold = hold

    def forwarded(self) -> None:
        self.sent_upstream = True

    def responded(self, status: int, now: float, sse: bool = False) -> None:
        """The response's status and first byte (headers, or the first body chunk)."""
        self.status, self.first_byte_s, self.sse = status, now, sse

    def watch(self, tracker: SSETracker | JSONTracker) -> None:
        """The response body goes by Sluice: its usage (or its text) is read from it."""
        self.tracker = tracker

    def usage_record(self, eu: EnvoyUsage | None) -> None:
        """What Envoy read of the usage, at the response's clean end."""
        self.envoy_usage = eu

    def settle_with(self, outcome: ResponseOutcome) -> None:
        """Settle with everything the response side told at once (``extproc.request.outcome``):
        the access log's entry, which comes after the response ended."""
        if self.settled:
            return
        start = self.arrived_s
        self.status = outcome.status
        if outcome.first_byte_after_s is not None:
            self.first_byte_s = start + outcome.first_byte_after_s
        if outcome.ended_after_s is not None:
            self.ended_s = start + outcome.ended_after_s
        self.envoy_usage, self.sse = outcome.usage, outcome.sse
        if outcome.served is not None and self.ticket is not None:
            # After a re-pick the hold moves to who served before it is released
            # (extproc.request.repick), as it does on the first response message.
            served_elsewhere(self.ticket, outcome.served, self.rt.metrics, self.rt.clock())
        self.settle(outcome.how)

    def settle_expired(self) -> None:
        """No access-log entry came within the route's timeout and a margin: release what
        the request holds; it keeps its pre-charge (nothing says what it used)."""
        self.settle(Ending.EXPIRED)

    # -- the exits -------------------------------------------------------------------------
    def charge_refused(self, reason: Reason) -> None:
        """A prompt refused after it was counted is paid for: its counted tokens, as spent."""
        if reason not in CHARGED or self.prompt_tokens <= 0:
            return
        tokens, self.prompt_tokens = self.prompt_tokens, 0
        self.rt.state.spend(self.tenant.name, self.limits, tokens, self.rt.clock())
        self.rt.metrics.charged_refused(self.tenant.name, reason, tokens)
        self.rt.settle_log.add(self.request_id, self.tenant.name, Ending.REJECTED, 0,
                               Basis.REFUSED_COUNTED, tokens, 0, tokens)

    def settle(self, how: Ending) -> None:
        """Release what the request holds; idempotent, called on every exit path."""
        if self.settled:
            return
        self.settled = True
        how = Ending(how)
        now = self.rt.clock()
        if not self.admitted:
            self._settle_budget(None)  # a budget reserved before TPM refused: all refunded
            # Refused before its pre-charge, but a half-open breaker may have let it in
            # as the probe: that place must be given back, or recovery stalls.
            if self.ticket is not None:
                self._release(self.ticket, Ending.REJECTED, now)
            return
        # A request that never left Sluice (refused, or abandoned while queued) used nothing.
        went = self.sent_upstream and how is not Ending.REJECTED
        got = self._charge(now, how) if went else Charge(0, Basis.NOT_SENT)
        self.rt.state.settle(self.tenant.name, self.reserved, got.tokens, now)
        self._settle_budget(self._used(got) if went else None)
        t = self.ticket
        if t is not None:
            self._release(t, how, now)
            if went and how is not Ending.REVOKED:
                self._observe_latency(t, how, now)
            if t.work:  # the fair share counts what it used, not what it reserved
                used = (
                    work(self.prompt_tokens, got.tokens - self.prompt_tokens) if got.tokens else 0.0
                )
                t.backend_state.queue.order.charge(self.tier.name, self.tenant.name, used - t.work,
                                                   now)
        self.rt.metrics.settled(how, self.tenant.name, got.tokens, self.reserved, got.basis)
        self.rt.settle_log.add(self.request_id, self.tenant.name, how, self.status, got.basis,
                               self.prompt_tokens, self.reserved, got.tokens)

    def _settle_budget(self, usage: Usage | None) -> None:
        """The budget's reservation becomes what was used (None: nothing went upstream),
        priced; the usage is recorded."""
        hold, wall = self.budget_hold, self.rt.wall()
        price = self.ticket.model.price if self.ticket is not None else None
        priced = ZERO if usage is None else spend(usage.prompt_tokens, usage.completion_tokens,
                                                  usage.cached_tokens, price)
        if hold is not None:
            self.budget_hold = None
            self.rt.budgets.settle(hold, priced, wall)
        if usage is not None and self.ticket is not None:
            model = self.ticket.model.name
            self.rt.usage.settled(self.tenant.name, model, usage.prompt_tokens, usage.completion_tokens,
                                  usage.cached_tokens, priced.nanos, wall)
            self.rt.metrics.spent(self.tenant.name, model, usage.prompt_tokens, usage.completion_tokens,
                                  usage.cached_tokens, priced.nanos)

    def _observe_latency(self, t: Ticket, how: Ending, now: float) -> None:
        assert self.req is not None
        try:
            observe.record_settle(self.rt, t, self.tenant.name, self.tier, how=how, status=self.status,
                                  arrived=self.arrived_s, first_byte=self.first_byte_s, now=self._ended(now),
                                  usage=self._reported_usage(), n=self.req.n)
        except Exception:  # observing must never keep the rest of settle from running
            log.exception("latency observation failed")

    def _reported_usage(self) -> Usage | None:
        """What the backend said it used: read by Sluice (streamed) or by Envoy (usage_trailers)."""
        if self.tracker is not None and self.tracker.usage is not None:
            return self.tracker.usage
        eu = self.envoy_usage
        if eu is not None and eu.input_tokens is not None and eu.output_tokens is not None:
            return Usage(eu.input_tokens, eu.output_tokens)
        return None

    def _release(self, t: Ticket, how: Ending, now: float) -> None:
        if t.admitted_at:
            self.rt.metrics.released()
            self.rt.track(self.tenant.name, -1)
        latency = self.first_byte_s - t.admitted_at if self.first_byte_s and t.admitted_at else None
        t.report_outcome(outcome_at_settle(how, self.status), latency, now)
        t.give_back(now)

    def _ended(self, now: float) -> float:
        """When the response ended: learned from the access log, else now (settle runs at the end)."""
        return self.ended_s if self.ended_s is not None else now

    def _charge(self, now: float, how: Ending) -> Charge:
        """What the request is charged (``extproc.policy.charge``), from what reached Sluice."""
        t, req = self.ticket, self.req
        assert t is not None and req is not None
        reported = self._reported_usage()
        if reported is not None:
            self._learn_rate(reported.completion_tokens)
        eu = self.envoy_usage
        # embeddings: prompt_tokens and total_tokens only
        total = reported.total if reported is not None else (
            eu.total_tokens if eu is not None else None)
        # Counting the text is the costly part: only when the charge may rest on it.
        counted = self._counted_completion() if total is None and self.status < 400 else None
        return charge(SettleFacts(
            prompt=self.prompt_tokens, completion_budget=max(0, self.reserved - self.prompt_tokens),
            n=req.n, admitted_at=t.admitted_at, ended_at=self._ended(now), status=self.status,
            first_byte_at=self.first_byte_s, streamed=self.sse or req.stream, reported_total=total,
            counted_completion=counted, rate=self.rt.decode_rates.rate(t.model.name),
            lost=how is Ending.EXPIRED,  # no access-log entry came: nothing says what it used
            revoked=how is Ending.REVOKED))

    def _used(self, got: Charge) -> Usage:
        """The charge split into prompt and completion tokens to price it, with the same total
        TPM settled: the backend's own usage when that is its basis (with the cached prompt
        tokens, priced apart), else the counted prompt and the rest as completion."""
        if got.basis is Basis.REPORTED:
            reported = self._reported_usage()
            # embeddings under usage_trailers: Envoy's total only, all of it prompt
            return reported if reported is not None else Usage(got.tokens, 0)
        prompt = min(self.prompt_tokens, got.tokens)
        return Usage(prompt, got.tokens - prompt)

    def _counted_completion(self) -> int | None:
        """The completion tokens in the body Sluice read, if it read what was generated:
        every event of a stream so far, or a whole JSON body (a cut one says nothing)."""
        tr = self.tracker
        if tr is None or (isinstance(tr, JSONTracker) and not tr.ended):
            return None
        assert self.ticket is not None
        uncounted = tr.uncounted if isinstance(tr, SSETracker) else 0  # events counted, not read
        read = self.rt.count_tokens_now(self.ticket.model.encoding, tr.texts) if tr.texts else 0
        return read + uncounted

    def _learn_rate(self, actual_completion: int) -> None:
        """A stream that reported its usage teaches the model's decode rate."""
        t, req, first = self.ticket, self.req, self.first_byte_s
        if t is None or req is None or first is None or not req.stream:
            return
        self.rt.decode_rates.observe(t.model.name, actual_completion, req.n, self._ended(self.rt.clock()) - first)
