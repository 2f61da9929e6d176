"""The usage estimate for responses whose usage never arrives (extproc/policy/decode_rate.py)."""

from __future__ import annotations

import pytest

from extproc.policy.decode_rate import DecodeRates, completion_estimate


def test_rate_is_learned_from_completed_streams_and_ignores_tiny_ones() -> None:
    r = DecodeRates()
    assert r.rate("m") is None
    r.observe("m", 2, 1, 1.0)  # too few tokens to say anything
    r.observe("m", 100, 1, 0.001)  # too short
    assert r.rate("m") is None
    r.observe("m", 100, 1, 2.0)
    assert r.rate("m") == pytest.approx(50.0)
    r.observe("m", 200, 2, 1.0)  # n choices generate side by side: per choice 100 tok/s
    assert r.rate("m") == pytest.approx(50 + 0.2 * 50)
    assert r.rate("other") is None


def test_estimate_is_capped_by_the_reservation_and_is_the_reservation_without_a_rate() -> None:
    assert completion_estimate(300, 1, None, 1.0) == 300
    assert completion_estimate(300, 1, 50.0, 1.0) == 50
    assert completion_estimate(300, 2, 50.0, 1.0) == 100
    assert completion_estimate(300, 1, 50.0, 100.0) == 300
    assert completion_estimate(300, 1, 50.0, -1.0) == 0


@pytest.mark.parametrize("jitter", [0.5, 0.8, 1.0, 1.25, 2.0])
def test_error_is_bounded_by_the_rate_error(jitter: float) -> None:
    """A stream at ``jitter`` x the learned pace, cut at any point: the estimate is off by
    the pace ratio (and one token of rounding), never more, and never above the budget."""
    rates = DecodeRates()
    for _ in range(20):
        rates.observe("m", 200, 1, 4.0)  # the model streams 50 tok/s
    true_rate = 50.0 * jitter
    for seconds in (0.1, 0.5, 1.0, 3.0, 10.0):
        streamed = min(500, int(true_rate * seconds))
        est = completion_estimate(500, 1, rates.rate("m"), seconds)
        assert est <= 500
        if streamed < 500:
            assert abs(est - streamed) <= abs(1 - 1 / jitter) * streamed + 1, (seconds, est, streamed)
