"""Budgets and prices as data, and the arithmetic between usage, prices and budgets.

A budget caps what a tenant may use per calendar period (``extproc.policy.period``),
in tokens, in money, or both. Money is counted in integer nano-units of the gateway's
currency (1e-9: a price of 0.075 per million tokens is 75 nanos a token), so sums are
exact in Python and in Redis (whose integers and Lua's doubles are exact to 2**53
nanos, about nine million currency units per tenant and period).

What a request reserves is its worst case: every prompt token at the uncached input
price and every completion at ``max_tokens`` (the completion budget Sluice enforces
upstream). What it spends is priced at settle from the usage the engine reported.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, tzinfo
from typing import NamedTuple

from extproc.policy.period import Span, span_at

__all__ = ["ALERTS", "NANOS", "Amount", "Budget", "Price", "ZERO", "format_money", "reservation", "spend"]

NANOS = 10**9  # nano-units per currency unit
ALERTS = (0.5, 0.8, 1.0)  # the soft thresholds reported by default


class Amount(NamedTuple):
    """Tokens and money (nanos) together: what a budget counts."""

    tokens: int
    nanos: int

    def plus(self, other: Amount) -> Amount:
        return Amount(self.tokens + other.tokens, self.nanos + other.nanos)

    def minus(self, other: Amount) -> Amount:
        return Amount(self.tokens - other.tokens, self.nanos - other.nanos)


ZERO = Amount(0, 0)


@dataclass(frozen=True, slots=True)
class Price:
    """A model's prices in nanos per token (the policy states them per million tokens)."""

    input: int = 0
    output: int = 0
    cached_input: int | None = None  # None: cached prompt tokens cost the input price


def reservation(prompt: int, completions: int, price: Price | None) -> Amount:
    """The worst case a request can use: ``completions`` is n x the enforced max_tokens."""
    tokens = prompt + completions
    if price is None:
        return Amount(tokens, 0)
    return Amount(tokens, prompt * price.input + completions * price.output)


def spend(prompt: int, completion: int, cached: int, price: Price | None) -> Amount:
    """What a settled request used, priced: cached prompt tokens at the cached price."""
    tokens = prompt + completion
    if price is None:
        return Amount(tokens, 0)
    cached = min(max(cached, 0), prompt)
    cached_price = price.input if price.cached_input is None else price.cached_input
    return Amount(tokens, (prompt - cached) * price.input + cached * cached_price + completion * price.output)


@dataclass(frozen=True, slots=True)
class Budget:
    """What a tenant may use per ``period`` in ``zone``; a limit of None is not counted."""

    period: str = "month"
    zone: tzinfo = field(default=UTC)
    tokens: int | None = None
    cost_nanos: int | None = None
    alerts: tuple[float, ...] = ALERTS
    # Derived once: every answer to a budgeted tenant names its period and limits.
    prefix: str = field(init=False, repr=False, compare=False, default="")
    cost_text: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", f"{self.period}:{self.zone}:")
        if self.cost_nanos is not None:
            object.__setattr__(self, "cost_text", format_money(self.cost_nanos))

    @property
    def limited(self) -> bool:
        """A budget with no limit at all (``budget: false`` on a tenant) is no budget."""
        return self.tokens is not None or self.cost_nanos is not None

    @property
    def zone_name(self) -> str:
        return str(self.zone)

    def span(self, wall: float) -> Span:
        return span_at(self.period, self.zone, wall)

    def key(self, span: Span) -> str:
        """The period's name where its spend is kept: a new period, zone or kind starts a new count."""
        return self.prefix + span.label

    def limit(self) -> Amount:
        """The limits as an Amount, an unlimited unit as -1 (the Redis script's convention)."""
        return Amount(-1 if self.tokens is None else self.tokens, -1 if self.cost_nanos is None else self.cost_nanos)

    def fits(self, used: Amount, cost: Amount) -> bool:
        """Whether ``cost`` fits beside what is already ``used`` (spent and reserved)."""
        return ((self.tokens is None or used.tokens + cost.tokens <= self.tokens)
                and (self.cost_nanos is None or used.nanos + cost.nanos <= self.cost_nanos))

    def exceeds(self, cost: Amount) -> bool:
        """A request that could never fit, even in an untouched period."""
        return not self.fits(ZERO, cost)

    def remaining(self, used: Amount) -> Amount:
        """What is left (never below 0); an unlimited unit reads -1."""
        return Amount(-1 if self.tokens is None else max(0, self.tokens - used.tokens),
                      -1 if self.cost_nanos is None else max(0, self.cost_nanos - used.nanos))

    def used_fraction(self, used: Amount) -> float:
        """The larger of the used shares of the limited units (1.0: spent)."""
        shares = []
        if self.tokens is not None:
            shares.append(used.tokens / self.tokens if self.tokens else 1.0)
        if self.cost_nanos is not None:
            shares.append(used.nanos / self.cost_nanos if self.cost_nanos else 1.0)
        return max(shares, default=0.0)


def format_money(nanos: int, places: int = 6) -> str:
    """Nanos as a decimal amount of the currency, e.g. 1500000000 -> '1.500000' (rounded half
    to even at ``places``, in integers: this runs on every answer to a budgeted tenant)."""
    if places >= 9:
        whole, frac = divmod(abs(nanos), NANOS)
        return f"{'-' if nanos < 0 else ''}{whole}.{frac:09d}{'0' * (places - 9)}"
    step = 10 ** (9 - places)
    q, r = divmod(abs(nanos), step)
    if r * 2 > step or (r * 2 == step and q % 2):
        q += 1
    whole, frac = divmod(q, 10**places)
    return f"{'-' if nanos < 0 else ''}{whole}.{frac:0{places}d}" if places else f"{'-' if nanos < 0 else ''}{whole}"
