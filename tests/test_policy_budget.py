"""Budgets (extproc.policy.budget, extproc.policy.budget_ledger): prices, reservations,
and the pre-charge/settle books that keep a period's spend within its budget."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.budget import ZERO, Amount, Budget, Price, format_money, reservation, spend
from extproc.policy.budget_ledger import LocalBudgets

PRICE = Price(input=150, output=600, cached_input=75)  # 0.15 / 0.60 / 0.075 per million tokens
DAY = Budget(period="day", tokens=1000)
T0 = datetime(2025, 3, 10, 12, 0, tzinfo=UTC).timestamp()


def test_a_reservation_is_the_worst_case_and_spend_prices_cached_tokens_lower() -> None:
    assert reservation(100, 2 * 50, PRICE) == Amount(200, 100 * 150 + 100 * 600)
    assert reservation(100, 50, None) == Amount(150, 0)
    assert spend(100, 20, 40, PRICE) == Amount(120, 60 * 150 + 40 * 75 + 20 * 600)
    assert spend(100, 20, 500, PRICE) == Amount(120, 100 * 75 + 20 * 600), "cached is at most the prompt"
    assert spend(100, 20, 40, Price(input=150, output=600)) == Amount(120, 100 * 150 + 20 * 600)
    # Spend never exceeds the reservation it was admitted with, whatever the cache did.
    assert spend(100, 50, 0, PRICE).nanos <= reservation(100, 50, PRICE).nanos


def test_money_is_printed_in_currency_units() -> None:
    assert format_money(1_500_000_000) == "1.500000"
    assert format_money(75) == "0.000000"
    assert format_money(75, places=9) == "0.000000075"


def test_a_budget_counts_only_the_units_it_limits() -> None:
    both = Budget(tokens=100, cost_nanos=1000)
    assert both.fits(Amount(50, 500), Amount(50, 500)) and not both.fits(Amount(50, 500), Amount(51, 0))
    assert not both.fits(ZERO, Amount(0, 1001))
    assert both.remaining(Amount(120, 200)) == Amount(0, 800)
    assert both.used_fraction(Amount(80, 900)) == 0.9
    tokens_only = Budget(tokens=100)
    assert tokens_only.fits(ZERO, Amount(100, 10**15)) and tokens_only.remaining(ZERO) == Amount(100, -1)
    assert not Budget().limited and Budget(cost_nanos=0).limited


def test_admit_reserves_settle_corrects_and_a_refusal_points_at_the_next_period() -> None:
    b = LocalBudgets()
    v = b.admit("t", DAY, Amount(600, 0), T0)
    assert v.admitted and v.hold is not None and v.view.used == Amount(600, 0)
    refused = b.admit("t", DAY, Amount(500, 0), T0 + 1)
    assert not refused.admitted and refused.reason == "budget"
    assert refused.retry_after_s == pytest.approx(12 * 3600 - 1), "midnight UTC is 12 h away"
    assert "1000 tokens per day" in refused.message and "400 tokens remain" in refused.message
    b.settle(v.hold, Amount(300, 0), T0 + 2)  # used 300 of its 600: the rest is free again
    assert b.view("t", DAY, T0 + 2).used == Amount(300, 0)
    again = b.admit("t", DAY, Amount(500, 0), T0 + 3)
    assert again.admitted and again.view.remaining == Amount(200, -1)
    assert again.hold is not None
    b.settle(again.hold, Amount(500, 0), T0 + 4)
    assert b.ledgers.snapshot()["balanced"] and b.ledgers.outstanding_t == 0


def test_a_request_larger_than_the_whole_budget_is_refused_without_a_retry() -> None:
    v = LocalBudgets().admit("t", DAY, Amount(1001, 0), T0)
    assert not v.admitted and v.reason == "budget_request_too_large" and v.retry_after_s is None


def test_a_request_settles_in_the_period_it_was_admitted_in() -> None:
    b = LocalBudgets()
    late = datetime(2025, 3, 10, 23, 59, 59, tzinfo=UTC).timestamp()
    v = b.admit("t", DAY, Amount(900, 0), late)
    assert v.hold is not None
    assert b.view("t", DAY, late + 2).used == ZERO, "the new day starts from nothing"
    b.settle(v.hold, Amount(800, 0), late + 5)
    assert b.view("t", DAY, late).used == Amount(800, 0)
    assert b.view("t", DAY, late + 5).used == ZERO
    assert b.admit("t", DAY, Amount(1000, 0), late + 6).admitted


def test_the_period_is_the_tenant_s_time_zone_s_day() -> None:
    tokyo = Budget(period="day", zone=ZoneInfo("Asia/Tokyo"), tokens=10)
    b = LocalBudgets()
    # 14:59:59 UTC is 23:59:59 in Tokyo: one second before its day ends
    v = b.admit("t", tokyo, Amount(10, 0), datetime(2025, 3, 10, 14, 59, 59, tzinfo=UTC).timestamp())
    refused = b.admit("t", tokyo, Amount(1, 0), datetime(2025, 3, 10, 14, 59, 59, tzinfo=UTC).timestamp())
    assert v.admitted and refused.retry_after_s == pytest.approx(1)
    assert b.admit("t", tokyo, Amount(10, 0), datetime(2025, 3, 10, 15, 0, 0, tzinfo=UTC).timestamp()).admitted


def test_force_reserves_past_the_budget_for_shadow_mode() -> None:
    b = LocalBudgets()
    assert b.admit("t", DAY, Amount(1000, 0), T0).admitted
    forced = b.admit("t", DAY, Amount(10, 0), T0, force=True)
    assert forced.admitted and forced.view.used == Amount(1010, 0) and forced.view.fraction == pytest.approx(1.01)


def test_the_durable_copy_seeds_a_period_this_process_has_not_opened() -> None:
    b = LocalBudgets()
    key = DAY.key(DAY.span(T0))
    b.seed("t", key, Amount(700, 0))
    b.seed("t", key, Amount(650, 0))  # an older copy never lowers it
    assert not b.admit("t", DAY, Amount(301, 0), T0).admitted
    v = b.admit("t", DAY, Amount(300, 0), T0)
    assert v.admitted and v.view.used == Amount(1000, 0)
    b.seed("t", key, Amount(900, 0))  # the book is open: the copy may count this process already
    assert b.view("t", DAY, T0).used == Amount(1000, 0)
    rows = b.report(T0)
    assert rows == [{"tenant": "t", "key": key, "start": DAY.span(T0).start, "end": DAY.span(T0).end,
                     "settled_tokens": 700, "settled_nanos": 0, "used_tokens": 1000, "used_nanos": 0}]


def test_settling_twice_fails_loudly() -> None:
    b = LocalBudgets()
    v = b.admit("t", DAY, Amount(10, 0), T0)
    assert v.hold is not None
    b.settle(v.hold, Amount(5, 0), T0)
    with pytest.raises(ValueError, match="twice"):
        b.settle(v.hold, Amount(5, 0), T0)


# -- never over budget, under any interleaving ------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(("admit", "settle")), st.integers(1, 400), st.integers(0, 110),
                         st.integers(0, 3)), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, tokens=st.integers(0, 3000), cost=st.integers(0, 5000), excess_pct=st.sampled_from((0, 10)))
def test_spend_never_exceeds_the_budget_plus_the_excess_over_reservations(
        ops: list[tuple[str, int, int, int]], tokens: int, cost: int, excess_pct: int) -> None:
    """Admits and settles in any order, some settling in a later period: each period's
    spend ends at most its budget plus what requests used beyond their reservations
    (none when usage never exceeds the reservation), and the books balance."""
    budget = Budget(period="minute", tokens=tokens, cost_nanos=cost)
    b = LocalBudgets()
    held: list = []
    excess_by_key: dict[str, Amount] = {}
    wall = T0
    for op, size, used_pct, advance in ops:
        wall += advance * 20  # three steps roll the minute
        if op == "admit":
            v = b.admit("t", budget, Amount(size, size * 2), wall)
            if v.admitted:
                assert v.hold is not None
                held.append(v.hold)
                assert budget.fits(ZERO, v.view.used) or excess_by_key.get(v.hold.key, ZERO) != ZERO, \
                    "a reservation never takes a period past its budget"
        elif held:
            h = held.pop(size % len(held))
            pct = min(used_pct, 100 + excess_pct)
            actual = Amount(h.cost.tokens * pct // 100, h.cost.nanos * pct // 100)
            over = Amount(max(0, actual.tokens - h.cost.tokens), max(0, actual.nanos - h.cost.nanos))
            excess_by_key[h.key] = excess_by_key.get(h.key, ZERO).plus(over)
            b.settle(h, actual, wall)
    for h in held:
        b.settle(h, h.cost, wall)
    for row in b.report(wall) + b.snapshot(wall)["periods"]:
        extra = excess_by_key.get(row["key"], ZERO)
        assert row["settled_tokens"] <= tokens + extra.tokens
        assert row["settled_nanos"] <= cost + extra.nanos
    assert b.ledgers.snapshot()["balanced"] and b.ledgers.outstanding_t == 0
