"""A tenant's budget at admission, in the steps ``Admission`` runs beside TPM's: the spent
check before the body (``precheck``) and the worst case reserved with the pre-charge
(``reserve``). What the reservation becomes is the ``Settlement``'s (``budgeted``).
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.openai_api.body import ParsedRequest
from extproc.openai_api.errors import budget_headers, retry_after_headers
from extproc.policy.budget import Amount, Budget, reservation
from extproc.policy.budget_ledger import BudgetVerdict
from extproc.policy.budget_ledger import refusal as refusal_of
from extproc.policy.reasons import Reason
from extproc.policy.schema import Policy, Tenant
from extproc.request.refusal import Refusal
from extproc.request.settle import Settlement
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime

__all__ = ["BudgetCharge"]


class BudgetCharge:
    def __init__(self, rt: Runtime, policy: Policy, tenant: Tenant, budget: Budget,
                 settlement: Settlement, unless_shadowed: Callable[..., bool]) -> None:
        # ``unless_shadowed(reason, count=True)``: the admission's shadow-mode decision
        self.rt, self.policy, self.tenant, self.budget = rt, policy, tenant, budget
        self.settlement, self.unless_shadowed = settlement, unless_shadowed

    def precheck(self) -> None:
        """A spent budget: refused as the admission would, before the body (one token; money only
        when every model has a price, a free model fits a spent cost budget)."""
        wall = self.rt.wall()
        view = self.rt.budgets.view(self.tenant.name, self.budget, wall)
        one = Amount(1, 1 if self.policy.all_priced() else 0)
        if self.budget.fits(view.used, one) or self.unless_shadowed(Reason.BUDGET, count=False):
            return
        raise _refusal(refusal_of(view, one, wall, self.policy.gateway.currency), wall)

    async def reserve(self, ticket: Ticket, req: ParsedRequest, prompt: int) -> None:
        """Reserve the request's worst case in the tenant's current period (n x the completion
        Sluice enforces upstream, every prompt token at the uncached price), or refuse; shadowed,
        reserve it past the budget (the books stay honest) and go on."""
        budget, wall = self.budget, self.rt.wall()
        cost = reservation(prompt, req.n * ticket.completion, ticket.model.price)
        v = self.rt.budgets.admit(self.tenant.name, budget, cost, wall)
        if not isinstance(v, BudgetVerdict):
            v = await v  # a shared store's lease was short: one round trip
        if not v.admitted and v.reason is not None and self.unless_shadowed(v.reason):
            forced = self.rt.budgets.admit(self.tenant.name, budget, cost, wall, force=True)
            assert isinstance(forced, BudgetVerdict)  # a forced reservation never waits for a store
            v = forced
        if not v.admitted or v.hold is None:
            raise _refusal(v, wall)
        self.settlement.budgeted(v.hold)
        ticket.budget = v.view


def _refusal(v: BudgetVerdict, wall: float) -> Refusal:
    assert v.reason is not None
    extra = budget_headers(v.view, wall)
    if v.retry_after_s is not None:
        extra.update(retry_after_headers(v.retry_after_s))
    code = "service_unavailable" if v.reason is Reason.STATE_STORE_DOWN else "rate_limit_exceeded"
    return Refusal(v.reason, v.message, code=code, headers=extra)
