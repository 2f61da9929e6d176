"""Budget admission with pre-charge and settle, per tenant and calendar period.

Enforced as TPM is (``extproc.policy.bucket``): a request reserves its worst case
(``budget.reservation``) when it is admitted, so concurrent requests can never
overshoot together, and settles to what it really used when its stream ends. Unlike a
bucket nothing refills: the period's count starts again when the next period starts.

How exact: a period's spend ends at most the budget plus the excess of requests that
used more than they reserved (``excess`` in the ledger). With the default reservation
(prompt + n x max_tokens, max_tokens enforced upstream) and an engine that reports the
prompt count Sluice counted, that excess is 0.

``LocalBudgets`` keeps the books in this process; ``extproc.store.budgets`` keeps them
in Redis for many replicas behind the same methods. Pure: callers pass ``wall`` (epoch
seconds: periods are calendar periods, unlike the monotonic ``now`` of the buckets).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from extproc.policy.budget import ZERO, Amount, Budget, format_money
from extproc.policy.period import Span
from extproc.policy.reasons import Reason

__all__ = ["BudgetHold", "BudgetLedgers", "BudgetVerdict", "BudgetView", "LocalBudgets", "refusal"]


class BudgetView(NamedTuple):
    """Where a tenant stands in its current period: ``used`` is spent plus reserved. (A
    NamedTuple: one or two are built per request, and a frozen dataclass costs ~1.5 us.)"""

    budget: Budget
    span: Span
    used: Amount

    @property
    def remaining(self) -> Amount:
        return self.budget.remaining(self.used)

    @property
    def fraction(self) -> float:
        return self.budget.used_fraction(self.used)

    @property
    def key(self) -> str:
        return self.budget.key(self.span)


class BudgetHold:
    """What an admitted request reserved in which period; settled exactly once."""

    __slots__ = ("tenant", "key", "cost", "done")

    def __init__(self, tenant: str, key: str, cost: Amount) -> None:
        self.tenant, self.key, self.cost, self.done = tenant, key, cost, False


class BudgetVerdict(NamedTuple):
    admitted: bool
    view: BudgetView
    hold: BudgetHold | None = None
    reason: Reason | None = None  # BUDGET, BUDGET_REQUEST_TOO_LARGE, STATE_STORE_DOWN
    message: str = ""
    retry_after_s: float | None = None  # to the next period; None: retrying cannot help


def refusal(view: BudgetView, cost: Amount, wall: float, currency: str) -> BudgetVerdict:
    """The refusal for a request of ``cost`` that does not fit beside ``view.used``."""
    b = view.budget
    if b.exceeds(cost):
        return BudgetVerdict(False, view, reason=Reason.BUDGET_REQUEST_TOO_LARGE,
                             message=f"This request could use {_amount(b, cost, currency)}, more than this key's "
                                     f"whole {b.period} budget ({_amount(b, b.limit(), currency)}). Lower "
                                     "max_tokens or shorten the prompt.")
    return BudgetVerdict(False, view, reason=Reason.BUDGET, retry_after_s=view.span.remaining_s(wall),
                         message=f"Budget reached: this key may use {_amount(b, b.limit(), currency)} per "
                                 f"{b.period} ({b.zone_name}); {_amount(b, view.remaining, currency)} remain and "
                                 f"this request could use {_amount(b, cost, currency)}. The next {b.period} "
                                 "starts in the Retry-After seconds.")


def _amount(b: Budget, a: Amount, currency: str) -> str:
    parts = []
    if b.tokens is not None:
        parts.append(f"{max(a.tokens, 0)} tokens")
    if b.cost_nanos is not None:
        parts.append(f"{format_money(max(a.nanos, 0))} {currency}")
    return " and ".join(parts)


class BudgetLedgers:
    """The budget's integer books, as TPM's ``Ledger`` keeps them: every reservation is
    settled once, and ``reserved + excess == spent + refunded + outstanding`` in tokens
    and in nanos. Plain integers: this runs twice per budgeted request."""

    __slots__ = ("reserved_t", "reserved_c", "spent_t", "spent_c", "refunded_t", "refunded_c", "excess_t",
                 "excess_c", "outstanding_t", "outstanding_c")

    def __init__(self) -> None:
        self.reserved_t = self.reserved_c = self.spent_t = self.spent_c = 0
        self.refunded_t = self.refunded_c = self.excess_t = self.excess_c = 0
        self.outstanding_t = self.outstanding_c = 0

    def reserved(self, cost: Amount) -> None:
        self.reserved_t += cost[0]
        self.reserved_c += cost[1]
        self.outstanding_t += cost[0]
        self.outstanding_c += cost[1]

    def settle_once(self, hold: BudgetHold, actual: Amount) -> None:
        """Settle ``hold`` to ``actual``, or fail loudly: a reservation settles exactly once."""
        if hold.done:
            raise ValueError("a budget reservation settled twice")
        hold.done = True
        self.settled(hold.cost, actual)

    def settled(self, cost: Amount, actual: Amount) -> None:
        if cost[0] > self.outstanding_t or cost[1] > self.outstanding_c:
            # Settling more than is in flight means a double settle somewhere: fail loudly.
            raise ValueError(f"a budget settle of {cost} exceeds what is reserved")
        self.outstanding_t -= cost[0]
        self.outstanding_c -= cost[1]
        self.spent_t += actual[0]
        self.spent_c += actual[1]
        dt, dc = cost[0] - actual[0], cost[1] - actual[1]
        if dt >= 0:
            self.refunded_t += dt
        else:
            self.excess_t -= dt
        if dc >= 0:
            self.refunded_c += dc
        else:
            self.excess_c -= dc

    def balanced(self) -> bool:
        return (self.reserved_t + self.excess_t == self.spent_t + self.refunded_t + self.outstanding_t
                and self.reserved_c + self.excess_c == self.spent_c + self.refunded_c + self.outstanding_c)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for unit, suffix in (("tokens", "_t"), ("nanos", "_c")):
            out[unit] = {k: getattr(self, k + suffix) for k in ("reserved", "spent", "refunded", "excess",
                                                                  "outstanding")}
        out["balanced"] = self.balanced()
        return out


class _Book:
    """One tenant's one period, in plain integers: ``base`` (the durable copy's, from before
    this process), ``spent`` (settled here), ``out`` (reserved, in flight)."""

    __slots__ = ("span", "base_t", "base_c", "spent_t", "spent_c", "out_t", "out_c")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.base_t = self.base_c = self.spent_t = self.spent_c = self.out_t = self.out_c = 0

    @property
    def used(self) -> Amount:
        return Amount(self.base_t + self.spent_t + self.out_t, self.base_c + self.spent_c + self.out_c)

    @property
    def settled(self) -> Amount:
        return Amount(self.base_t + self.spent_t, self.base_c + self.spent_c)


class LocalBudgets:
    """Budget books in this process (``gateway.state: memory``)."""

    shared = False

    def __init__(self, currency: str = "USD") -> None:
        self.currency = currency
        self._books: dict[tuple[str, str], _Book] = {}
        self._seeds: dict[tuple[str, str], Amount] = {}
        self.ledgers = BudgetLedgers()

    def _book(self, tenant: str, budget: Budget, wall: float) -> tuple[str, _Book]:
        span = budget.span(wall)
        key = budget.key(span)
        book = self._books.get((tenant, key))
        if book is None:
            book = self._books[(tenant, key)] = _Book(span)
            seed = self._seeds.pop((tenant, key), None)
            if seed is not None:
                book.base_t, book.base_c = seed
        return key, book

    def admit(self, tenant: str, budget: Budget, cost: Amount, wall: float,
              force: bool = False) -> BudgetVerdict:
        """Reserve ``cost`` in the current period, or refuse; ``force`` reserves past the
        budget (shadow mode keeps honest books)."""
        key, book = self._book(tenant, budget, wall)
        t, c = cost
        used_t, used_c = book.base_t + book.spent_t + book.out_t, book.base_c + book.spent_c + book.out_c
        if not force and ((budget.tokens is not None and used_t + t > budget.tokens)
                          or (budget.cost_nanos is not None and used_c + c > budget.cost_nanos)):
            return refusal(BudgetView(budget, book.span, Amount(used_t, used_c)), cost, wall, self.currency)
        book.out_t += t
        book.out_c += c
        self.ledgers.reserved(cost)
        return BudgetVerdict(True, BudgetView(budget, book.span, Amount(used_t + t, used_c + c)),
                             BudgetHold(tenant, key, cost))

    def settle(self, hold: BudgetHold, actual: Amount, wall: float) -> None:
        """The request used ``actual``: in the period it was admitted in, whenever it ends."""
        self.ledgers.settle_once(hold, actual)
        book = self._books.get((hold.tenant, hold.key))
        if book is not None:
            book.out_t -= hold.cost[0]
            book.out_c -= hold.cost[1]
            book.spent_t += actual[0]
            book.spent_c += actual[1]
        self._prune(wall)

    def view(self, tenant: str, budget: Budget, wall: float) -> BudgetView:
        span = budget.span(wall)
        book = self._books.get((tenant, budget.key(span)))
        return BudgetView(budget, span, book.used if book is not None else ZERO)

    def seed(self, tenant: str, key: str, settled: Amount) -> None:
        """The durable copy's spend of a period (the console's, from earlier processes),
        taken when this process opens that period's book.

        A book already open is left alone: once this process has reported it, the copy
        includes what this process spent, and taking it again would count that twice. So
        a restarted replica fetches the copy before it serves (``ConsoleClient``).
        """
        if (tenant, key) in self._books:
            return
        prior = self._seeds.get((tenant, key), ZERO)
        self._seeds[(tenant, key)] = Amount(max(prior.tokens, settled.tokens), max(prior.nanos, settled.nanos))

    def _prune(self, wall: float) -> None:
        if len(self._books) < 64:
            return
        for k in [k for k, b in self._books.items() if b.span.end <= wall and not (b.out_t or b.out_c)]:
            del self._books[k]

    def forget(self, keep: set[str]) -> None:
        """Books of tenants no longer in the policy go (in-flight holds settle harmlessly)."""
        for k in [k for k in self._books if k[0] not in keep]:
            del self._books[k]

    def report(self, wall: float) -> list[dict[str, Any]]:
        """Every current or unsettled period's books, for the console's durable copy."""
        return [period_row(t, k, b.span, b.settled, b.used) for (t, k), b in self._books.items()
                if b.span.end > wall or b.out_t or b.out_c]

    def snapshot(self, wall: float) -> dict[str, Any]:
        return {"kind": "memory", "ledgers": self.ledgers.snapshot(), "periods": self.report(wall)}


def period_row(tenant: str, key: str, span: Span, settled: Amount, used: Amount) -> dict[str, Any]:
    """One period's books as the status report carries them (``console.budgets`` reads it)."""
    return {"tenant": tenant, "key": key, "start": span.start, "end": span.end,
            "settled_tokens": settled.tokens, "settled_nanos": settled.nanos,
            "used_tokens": used.tokens, "used_nanos": used.nanos}
