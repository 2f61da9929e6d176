"""OpenAI-shaped error bodies and the rate-limit headers clients act on.

Each refusal's status and error type is its ``extproc.policy.reasons.Reason``'s.
"""

from __future__ import annotations

import json
import math
import random

from extproc.policy.budget import format_money
from extproc.policy.budget_ledger import BudgetView
from extproc.policy.gate import RateView


def error_body(message: str, etype: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": etype, "param": param, "code": code}},
                      ensure_ascii=False).encode()


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '20ms'."""
    if seconds <= 0:
        return "0s"
    if not math.isfinite(seconds):
        return "0s" if math.isnan(seconds) else "1h0m0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds * 10) / 10
    minutes, rest = divmod(s, 60)
    rest_s = f"{rest:.1f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


# Clients refused in the same second must not all come back in the same second: the
# advertised delay gets a uniform extra of up to JITTER_FRACTION of itself, at most
# JITTER_MAX_S, drawn per rejection.
JITTER_FRACTION = 0.25
JITTER_MAX_S = 1.0
_rng = random.Random()


def jitter_bound(seconds: float) -> float:
    """The largest extra delay added to a wait of ``seconds``."""
    return min(JITTER_FRACTION * max(seconds, 0.0), JITTER_MAX_S)


def retry_after_headers(seconds: float, jitter: float | None = None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, >= 1) and ``retry-after-ms`` for a wait of ``seconds``.

    ``jitter`` is the uniform draw in [0, 1) (tests pass one to check the bounds); by
    default each call draws its own. Both headers carry the same jittered delay:
    ``retry-after-ms`` to the millisecond, ``Retry-After`` rounded up, so a client obeying
    either is never early.
    """
    seconds = seconds if math.isfinite(seconds) else 3600.0  # "never" still needs a number
    u = _rng.random() if jitter is None else min(max(jitter, 0.0), 1.0)
    delay = max(seconds, 0.0) + u * jitter_bound(seconds)
    return {"retry-after": str(max(1, math.ceil(delay))), "retry-after-ms": str(max(1, math.ceil(delay * 1000)))}


# Where a tenant with a budget stands in its period, on every answer it gets (docs/budgets.md).
BUDGET_HEADERS = ("x-ratelimit-limit-budget-tokens", "x-ratelimit-remaining-budget-tokens",
                  "x-ratelimit-limit-budget-cost", "x-ratelimit-remaining-budget-cost", "x-ratelimit-reset-budget",
                  "x-sluice-budget-period")


def budget_headers(view: BudgetView, wall: float) -> dict[str, str]:
    """The budget's limit and what is left of it (not yet spent or reserved), per limited unit;
    the time to the next period; the period counted."""
    b, left = view.budget, view.remaining
    out = {}
    if b.tokens is not None:
        out["x-ratelimit-limit-budget-tokens"] = str(b.tokens)
        out["x-ratelimit-remaining-budget-tokens"] = str(left.tokens)
    if b.cost_nanos is not None:
        out["x-ratelimit-limit-budget-cost"] = b.cost_text
        out["x-ratelimit-remaining-budget-cost"] = format_money(left.nanos)
    out["x-ratelimit-reset-budget"] = format_duration(view.span.remaining_s(wall))
    out["x-sluice-budget-period"] = view.key
    return out


def ratelimit_headers(tokens: RateView, requests: RateView) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*``: where the key stands on tokens and requests per minute."""
    return {
        "x-ratelimit-limit-tokens": str(tokens.limit),
        "x-ratelimit-remaining-tokens": str(tokens.remaining),
        "x-ratelimit-reset-tokens": format_duration(tokens.reset_s),
        "x-ratelimit-limit-requests": str(requests.limit),
        "x-ratelimit-remaining-requests": str(requests.remaining),
        "x-ratelimit-reset-requests": format_duration(requests.reset_s),
    }
