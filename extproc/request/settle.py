"""How a stream settles: the one exit that gives back what a request held, exactly once.

``settle()`` runs on every way a stream ends (``extproc.request.stream``): it charges the
tenant what the request used (the usage the backend reported, Envoy's usage record,
or an estimate) and refunds the rest of its pre-charge, releases its slot and KV,
reports the outcome to the breakers that let it through, and feeds the latency
observations. A prompt refused after it was counted is charged as spent
(``_charge_refused``).
"""

from __future__ import annotations

import logging

from extproc.envoy.usage_record import EnvoyUsage
from extproc.openai_api.body import ParsedRequest
from extproc.openai_api.usage import JSONTracker, SSETracker, Usage
from extproc.policy.breaker import outcome_at_settle
from extproc.policy.decode_rate import completion_estimate
from extproc.policy.schema import Limits, Policy, Tenant
from extproc.request import observe as latency
from extproc.request.admission import Ticket
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.stream")

# Refusals that come after the prompt was counted, for a reason retrying cannot fix:
# the counting is charged to the tenant's TPM budget (see _charge_refused).
CHARGED_REFUSALS = frozenset({"context_length", "too_large_for_backend", "tpm_request_too_large",
                              "tokenizer_failed"})


class Settlement:
    """The settle side of ``extproc.request.stream.StreamProcessor``, which sets these attributes."""

    rt: Runtime
    policy: Policy
    tenant: Tenant | None
    limits: Limits | None
    req: ParsedRequest | None
    ticket: Ticket | None
    prompt_tokens: int
    reserved: int
    admitted: bool
    settled: bool
    forwarded: bool
    status: int
    first_byte_s: float | None
    arrived_s: float
    tracker: SSETracker | JSONTracker | None
    envoy_usage: EnvoyUsage | None
    sse: bool

    def _charge_refused(self, reason: str) -> None:
        """A prompt refused after it was counted is paid for: its counted tokens, as spent."""
        if reason not in CHARGED_REFUSALS or self.prompt_tokens <= 0 or self.tenant is None or self.limits is None:
            return
        tokens, self.prompt_tokens = self.prompt_tokens, 0
        self.rt.state.spend(self.tenant.name, self.limits, tokens, self.rt.clock())
        self.rt.metrics.charged_refused(self.tenant.name, reason, tokens)

    # -- the one exit -------------------------------------------------------
    def settle(self, how: str) -> None:
        """Release what the request holds; idempotent, called on every exit path."""
        if self.settled:
            return
        self.settled = True
        now = self.rt.clock()
        if not self.admitted:
            # Refused before its pre-charge, but a half-open breaker may have let it in
            # as the probe: that place must be given back, or recovery stalls.
            if self.ticket is not None:
                self._release(self.ticket, "rejected", now)
            return
        assert self.tenant is not None
        # A request that never left Sluice (refused, or abandoned while queued) used nothing.
        actual = self._actual_usage(how) if self.forwarded and how != "rejected" else 0
        self.rt.state.settle(self.tenant.name, self.reserved, actual, now)
        t = self.ticket
        if t is not None:
            self._release(t, how, now)
            if self.forwarded and how != "rejected":
                self._observe_latency(t, how, now)
        self.rt.metrics.settled(how, self.tenant.name, actual, self.reserved)

    def _observe_latency(self, t: Ticket, how: str, now: float) -> None:
        assert self.tenant is not None and self.req is not None
        usage = self._reported_usage()
        try:
            latency.record_settle(self.rt, t, self.tenant.name, self.policy.tiers[self.tenant.tier], how=how,
                                  status=self.status, arrived=self.arrived_s, first_byte=self.first_byte_s,
                                  now=now, usage=usage, n=self.req.n)
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

    def _release(self, t: Ticket, how: str, now: float) -> None:
        assert self.tenant is not None
        if t.admitted_at:
            self.rt.metrics.released()
            self.rt.track(self.tenant.name, -1)
        latency = self.first_byte_s - t.admitted_at if self.first_byte_s and t.admitted_at else None
        t.report_outcome(outcome_at_settle(how, self.status), latency, now)
        if t.hold is not None:
            hold, t.hold = t.hold, None
            t.runtime.release(hold, now)

    def _actual_usage(self, how: str) -> int:
        reported = self._reported_usage()
        if reported is not None:
            self._learn_rate(reported.completion_tokens)
            return reported.total
        tr, eu = self.tracker, self.envoy_usage
        if eu is not None and eu.total_tokens is not None:
            return eu.total_tokens  # embeddings: prompt_tokens and total_tokens only
        if how == "end_of_stream" and self.status >= 400:
            # The backend refused or failed before generating: nothing to bill.
            return 0
        if tr is None and self.first_byte_s is not None and self.status:
            # usage_trailers: a successful response whose usage never came (see estimate).
            return self.prompt_tokens + self._estimated_completion()
        if tr is None:
            # Never got response headers (upstream reset, disconnect while waiting):
            # the backend may have done the prefill, so the prompt counts.
            return self.prompt_tokens if how != "end_of_stream" else 0
        model = self.ticket.model if self.ticket is not None else None
        assert model is not None
        return self.prompt_tokens + self.rt.count_tokens_now(model.encoding, tr.texts)

    def _estimated_completion(self) -> int:
        t, req, first = self.ticket, self.req, self.first_byte_s
        assert t is not None and req is not None and first is not None
        now = self.rt.clock()
        seconds = now - first if self.sse else first - t.admitted_at
        return completion_estimate(max(0, self.reserved - self.prompt_tokens), req.n,
                                   self.rt.decode_rates.rate(t.model.name), seconds)

    def _learn_rate(self, actual_completion: int) -> None:
        """A stream that reported its usage teaches the model's decode rate."""
        t, req, first = self.ticket, self.req, self.first_byte_s
        if t is None or req is None or first is None or not req.stream:
            return
        self.rt.decode_rates.observe(t.model.name, actual_completion, req.n, self.rt.clock() - first)
