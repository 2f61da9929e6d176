"""What a forwarded request is charged when it ends (extproc/policy/charge.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.charge import Basis, Charge, SettleFacts, charge, generating_s


def ending(**kw: object) -> SettleFacts:
    base: dict[str, object] = {
        "prompt": 100,
        "completion_budget": 1000,
        "n": 1,
        "admitted_at": 10.0,
        "ended_at": 19.0,
        "rate": 50.0,
    }
    return SettleFacts(**{**base, **kw})  # type: ignore[arg-type]


def test_the_backends_usage_wins_over_everything_else() -> None:
    assert charge(ending(reported_total=345, status=500, counted_completion=7)) == Charge(
        345, Basis.REPORTED
    )


def test_an_end_nobody_reported_keeps_the_reservation() -> None:
    # an access-log entry that never came: the prompt and the whole reserved completion
    assert charge(ending(lost=True)) == Charge(1100, Basis.LOST)
    assert charge(ending(lost=True, ended_at=10.5)) == Charge(1100, Basis.LOST)  # not estimated


def test_an_error_answer_is_not_billed() -> None:
    assert charge(ending(status=400, first_byte_at=10.2)) == Charge(0, Basis.FAILED)
    assert charge(ending(status=503, first_byte_at=10.2, counted_completion=0)) == Charge(
        0, Basis.FAILED
    )


def test_a_completion_sluice_read_is_the_prompt_plus_what_it_counted() -> None:
    assert charge(
        ending(status=200, first_byte_at=10.1, streamed=True, counted_completion=42)
    ) == Charge(142, Basis.COUNTED)


def test_a_client_that_left_before_any_answer_pays_for_the_time_the_engine_may_have_generated() -> (
    None
):
    """Eight clients asking for 1000 tokens and hanging up after 9 s were charged their
    prompt alone while the engine generated for 9 s: now 9 s x 50 tokens/s is charged."""
    c = charge(ending())
    assert c == Charge(100 + 450, Basis.ESTIMATED)
    assert charge(ending(n=2)).tokens == 100 + 900
    # Never more than the reservation, and the reservation without a learned rate.
    assert charge(ending(ended_at=100.0)).tokens == 1100
    assert charge(ending(rate=None, ended_at=10.5)).tokens == 1100
    # Embeddings have no completion: the prompt.
    assert charge(ending(n=0, completion_budget=0)).tokens == 100


def test_a_request_sluice_revoked_before_any_answer_is_not_billed() -> None:
    """Sluice ended it for a higher tier's room and told the client to retry: it pays nothing,
    even after long in the engine's queue (the estimate would charge it the time)."""
    assert charge(ending(revoked=True)) == Charge(0, Basis.REVOKED)
    assert charge(ending(revoked=True, ended_at=100.0, rate=None)) == Charge(0, Basis.REVOKED)


def test_a_revoked_stream_that_had_answered_pays_what_it_produced() -> None:
    answered = ending(revoked=True, status=200, first_byte_at=10.1, streamed=True)
    assert charge(replace(answered, counted_completion=42)) == Charge(142, Basis.COUNTED)
    assert charge(replace(answered, reported_total=150)) == Charge(150, Basis.REPORTED)
    assert charge(answered).basis is Basis.ESTIMATED  # nothing read: the time it streamed


def test_the_generating_time_depends_on_what_arrived() -> None:
    assert generating_s(ending()) == pytest.approx(9.0)  # no answer: since admission
    assert generating_s(ending(first_byte_at=10.5, streamed=True)) == pytest.approx(
        8.5
    )  # since the first byte
    assert generating_s(ending(first_byte_at=14.0)) == pytest.approx(
        4.0
    )  # a JSON answer comes when done
    assert charge(ending(status=200, first_byte_at=14.0)) == Charge(100 + 200, Basis.ESTIMATED)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(0, 10_000),
    budget=st.integers(0, 4096),
    n=st.integers(1, 4),
    learned=st.floats(1.0, 500.0),
    slower=st.floats(0.1, 1.0),
    queued=st.floats(0.0, 5.0),
    generating=st.floats(0.0, 60.0),
)
def test_an_estimate_is_bounded_by_the_reservation_and_covers_an_engine_no_faster_than_learned(
    prompt: int,
    budget: int,
    n: int,
    learned: float,
    slower: float,
    queued: float,
    generating: float,
) -> None:
    """The documented bound: prompt <= charge <= prompt + reservation; and when the engine
    decoded no faster than the learned rate, the charge covers every token it generated
    (it waited ``queued`` before generating, which only adds to the charge)."""
    e = ending(
        prompt=prompt,
        completion_budget=budget,
        n=n,
        admitted_at=0.0,
        ended_at=queued + generating,
        rate=learned,
    )
    c = charge(e)
    assert c.basis is Basis.ESTIMATED
    assert prompt <= c.tokens <= prompt + budget
    generated = min(budget, int(n * learned * slower * generating))
    assert c.tokens >= prompt + generated
