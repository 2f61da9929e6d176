"""What an admitted request holds until it settles, and the three ways that changes.

Admission (``extproc.request.admission``) fills a ticket in; after that only these
methods change it: the hold follows a re-pick (``moved``), goes back once (``give_back``),
and the breakers that let the request through hear how it ended once
(``report_outcome``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field, replace

from extproc.backends.hold import Hold
from extproc.backends.state import BackendState
from extproc.policy.admit import SlotRequest
from extproc.policy.breaker import BreakerVerdict
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.budget_ledger import BudgetView
from extproc.policy.gate import Verdict
from extproc.policy.schema import Backend, Model

__all__ = ["Ticket"]


@dataclass
class Ticket:
    backend: Backend
    model: Model
    backend_state: BackendState  # the backend's live slots, KV, queue and breakers
    completion: int  # tokens reserved per generated completion
    tenant: str = ""
    degraded: list[str] = field(default_factory=list)
    verdict: Verdict | None = None  # the TPM/RPM pre-charge's
    budget: BudgetView | None = None  # the budget's standing after its pre-charge (the tenant has one)
    hold: Hold | None = None
    kv: int = 0
    admitted_at: float = 0.0
    queued_s: float = 0.0
    breaker_verdict: BreakerVerdict | None = None
    route_verdict: BreakerVerdict | None = None  # the model route's own breaker, if it has one
    tenant_verdict: BreakerVerdict | None = None  # the tenant's breaker on this backend
    lease_short: SlotRequest | None = None  # refused for room in a shared lease: retried after one lease check
    lease_checked: Awaitable[None] | None = None  # done when that check has ended (SlotLeases.next_check)
    prefix: tuple[int, ...] = ()  # prompt prefix keys when the pool has prefix affinity (extproc.openai_api.prefix_key)
    # its fair-share work as reserved (extproc.policy.fair_share), corrected at settle
    work: float = 0.0

    def report_outcome(self, outcome: Outcome, latency_s: float | None, now: float) -> None:
        """Tell each breaker that let this request through how it ended; once. Admission gives
        a probe place back with ``CANCELLED``; settle reports ``outcome_at_settle``.

        The tenant's breakers hear first and decide who a failure is blamed on: a failure
        of this tenant alone reaches the backend's breakers as ``TENANT_FAILURE``, which
        they ignore.
        """
        be = self.backend_state
        shared = outcome
        if self.tenant_verdict is not None:
            shared = be.tenants_for(self.model.name).record(self.tenant, outcome, now,
                                                            admitted=self.tenant_verdict.allowed)
        if self.hold is not None and self.hold.endpoint is not None and be.endpoints is not None:
            # The endpoint's own breaker ejects it from picking; a failure of one endpoint
            # while others are usable is not the pool's.
            shared = be.endpoints.record(self.hold.endpoint, shared, latency_s, now)
        if self.breaker_verdict is not None and self.breaker_verdict.allowed:
            be.breaker.record(shared, latency_s, now)
        rb = be.route_breakers.get(self.model.name)
        if rb is not None and self.route_verdict is not None and self.route_verdict.allowed:
            rb.record(shared, latency_s, now)
        self.breaker_verdict = self.route_verdict = self.tenant_verdict = None

    def give_back(self, now: float) -> None:
        """Release the slot and KV the request holds; a second call finds nothing to release."""
        if self.hold is not None:
            hold, self.hold = self.hold, None
            self.backend_state.release(hold, now)

    def moved(self, to: str) -> None:
        """The request runs on pool endpoint ``to`` now (Envoy re-picked): its hold is there,
        with no second choice left."""
        assert self.hold is not None
        self.hold = replace(self.hold, endpoint=to, second=None)
