"""OpenAI-shaped error bodies, reset durations and Retry-After headers."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.openai_api.errors import (
    JITTER_MAX_S,
    error_body,
    format_duration,
    jitter_bound,
    retry_after_headers,
)
from extproc.policy.reasons import Reason

# What OpenAI sends in x-ratelimit-reset-*, and what clients that parse it accept.
OPENAI_DURATION = re.compile(r"^(?:\d+ms|\d+(?:\.\d+)?s|\d+m\d+(?:\.\d+)?s)$")


def parse_duration(text: str) -> float:
    """A client-side parser for the OpenAI reset format."""
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)m)?(\d+(?:\.\d+)?)s", text)
    assert m, text
    return int(m.group(1) or 0) * 60 + float(m.group(2))


def test_error_body_is_openai_shaped() -> None:
    body = json.loads(error_body("Rate limit reached: ü", "rate_limit_exceeded", "rpm", "messages"))
    assert body == {"error": {"message": "Rate limit reached: ü", "type": "rate_limit_exceeded",
                              "param": "messages", "code": "rpm"}}
    plain = json.loads(error_body("x", "server_error", None))
    assert plain["error"]["code"] is None and plain["error"]["param"] is None


def test_error_body_is_utf8_and_escapes_quotes() -> None:
    raw = error_body('say "hi" \\ 世界', "invalid_request_error", "bad")
    assert "世界".encode() in raw
    assert json.loads(raw)["error"]["message"] == 'say "hi" \\ 世界'


def test_reasons_map_to_documented_statuses() -> None:
    assert Reason("unknown_key").status == 401
    assert Reason("body_too_large").status == 413
    assert Reason("bad_request").status == Reason("context_length").status == 400
    for r in ("tpm", "rpm", "slots", "tpm_request_too_large", "queue_full"):
        assert (Reason(r).status, Reason(r).error_type) == (429, "rate_limit_exceeded")
    for r in ("breaker_open", "overloaded", "queue_timeout", "state_store_down"):
        assert (Reason(r).status, Reason(r).error_type) == (503, "server_error")
    assert Reason("unsupported_encoding").status == 415  # a body Sluice did not decode
    edge = Reason("edge_rate_limited")
    assert (edge.status, edge.error_type) == (429, "rate_limit_exceeded")
    statuses = (400, 401, 404, 408, 413, 415, 429, 499, 503)
    assert all(isinstance(r, str) and r.status in statuses for r in Reason)


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (-3, "0s"),
        (0.0001, "1ms"),
        (0.02, "20ms"),
        (0.0201, "21ms"),
        (0.5, "500ms"),
        (1, "1s"),
        (1.25, "1.3s"),
        (6.0, "6s"),
        (59.5, "59.5s"),
        (60, "1m0s"),
        (90, "1m30s"),
        (90.05, "1m30.1s"),
        (360, "6m0s"),
        (3600, "60m0s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert OPENAI_DURATION.match(text)


@given(st.floats(min_value=0, max_value=10 * 86400, allow_nan=False))
def test_format_duration_is_parseable_and_never_early(seconds: float) -> None:
    text = format_duration(seconds)
    assert OPENAI_DURATION.match(text), text
    parsed = parse_duration(text)
    # Rounded up (a client waiting this long is never too early), by at most 0.1 s.
    assert parsed >= seconds - 1e-9
    assert parsed <= seconds + 0.1 + 1e-6


@pytest.mark.parametrize(
    "seconds, after, after_ms",
    [(0, "1", "1"), (-5, "1", "1"), (0.0004, "1", "1"), (0.2, "1", "200"), (1.0, "1", "1000"),
     (1.01, "2", "1010"), (59.9, "60", "59900")],
)
def test_retry_after_headers(seconds: float, after: str, after_ms: str) -> None:
    assert retry_after_headers(seconds, jitter=0.0) == {"retry-after": after, "retry-after-ms": after_ms}


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.floats(min_value=0, max_value=1, exclude_max=True))
def test_retry_after_rounds_up_and_is_at_least_one(seconds: float, u: float) -> None:
    h = retry_after_headers(seconds, jitter=u)
    delay = seconds + u * jitter_bound(seconds)
    assert int(h["retry-after"]) >= max(1, delay)
    assert int(h["retry-after"]) < max(1, delay) + 1
    assert int(h["retry-after-ms"]) >= max(1, delay * 1000)
    # The two headers say the same thing: Retry-After is retry-after-ms rounded up to seconds.
    assert int(h["retry-after"]) == max(1, -(-int(h["retry-after-ms"]) // 1000))


@pytest.mark.parametrize("seconds, bound", [(0.4, 0.1), (2.0, 0.5), (4.0, 1.0), (30.0, JITTER_MAX_S)])
def test_jitter_is_a_quarter_of_the_wait_at_most_one_second(seconds: float, bound: float) -> None:
    assert jitter_bound(seconds) == pytest.approx(bound)
    assert retry_after_headers(seconds, jitter=0.0)["retry-after-ms"] == str(round(seconds * 1000))
    top = int(retry_after_headers(seconds, jitter=0.999999)["retry-after-ms"])
    assert round((seconds + bound) * 1000) - 1 <= top <= round((seconds + bound) * 1000)


def test_rejections_in_the_same_second_spread_their_retry_within_the_bound() -> None:
    for seconds in (1.0, 2.0, 30.0):
        lo, hi = seconds * 1000, (seconds + jitter_bound(seconds)) * 1000
        advertised = [int(retry_after_headers(seconds)["retry-after-ms"]) for _ in range(50)]
        assert len(set(advertised)) > 10, advertised  # not all the same second, nor the same millisecond
        assert all(lo <= a <= hi for a in advertised), advertised
    # Whole seconds move too when the jitter crosses a second: 30.5 s + [0, 1 s) is told 31 or 32.
    assert {retry_after_headers(30.5)["retry-after"] for _ in range(50)} == {"31", "32"}
