"""What a request that went to a backend is charged when it ends: one rule, whatever path
reported the end (the ext_proc response phases, or Envoy's access log).

From what Sluice knows best to what it must estimate (``Basis``):

0. ``REVOKED``: Sluice itself ended the request before any answer, to give a higher tier
   its KV room back (``extproc.policy.revoke``): nothing. The client asked for nothing it
   got and is told to retry; the prefill the engine did is the operator's cost (counted as
   revoked work). A revoked stream that had answered is charged by the rules below, for
   what it produced.
1. ``REPORTED``: the backend's usage (read by Sluice from the body, or Envoy's usage
   record): exactly that.
2. ``FAILED``: the backend answered an error status (>= 400): nothing. A refusal generates
   nothing; a failure after generating (an out-of-memory 500) is the operator's loss, not
   the tenant's bill.
3. ``COUNTED``: Sluice read the completion as it was produced (a stream, or a whole JSON
   body): the prompt plus the tokens counted. The engine may have produced a few more after
   the last chunk Sluice saw (those in flight when the stream was cut), never fewer.
4. ``ESTIMATED``: everything else, which is every request whose client left before or
   during the answer under ``usage_trailers``, and every one that left before any answer:
   the prompt plus ``min(reserved completion, n × rate × generating time)``
   (``extproc.policy.decode_rate``). The generating time is now − first byte for a stream
   whose headers came, first byte − admission for a non-streaming answer, and now −
   admission when no answer came at all (the engine may have been generating the whole
   time: vLLM answers a non-streaming request only when it is done). Without a learned
   rate the whole reservation is charged.

The bound of an estimate: it never exceeds the prompt plus the reservation (what the
client agreed to). It is at least what the engine generated when the model's learned
rate is at least the request's own decode rate, because the time it is multiplied by
includes the engine's queueing and prefill; the excess is that time × rate. The prompt is
charged whether or not the engine began its prefill, which Sluice cannot see.

One ending says nothing of what the request used: under ``response_processing:
access_log`` the request's entry never came within the route's timeout and a margin
(``LOST``): the reservation stands, prompt plus reserved completion, the most the client
agreed to (the route's timeout has passed, so any estimate would reach it too).

Two endings never reach the backend and are not decided here: a request refused or
abandoned before it was forwarded is charged nothing (``NOT_SENT``); one refused after its
prompt was counted, for a reason a retry cannot fix, is charged the counted prompt
(``REFUSED_COUNTED``: the work of counting it, done for nothing).

Pure: no clock, no I/O; times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from extproc.policy.decode_rate import completion_estimate

__all__ = ["Basis", "Charge", "SettleFacts", "charge", "generating_s"]


class Basis(StrEnum):
    """How a charge was arrived at (a metric label, and the settle record's ``basis``)."""

    REPORTED = "reported"
    FAILED = "failed"
    COUNTED = "counted"
    ESTIMATED = "estimated"
    REVOKED = "revoked"
    NOT_SENT = "not_sent"
    REFUSED_COUNTED = "refused_counted"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class SettleFacts:
    """What is known about a forwarded request when it ends."""

    prompt: int  # prompt tokens Sluice counted
    completion_budget: int  # completion tokens reserved, all choices together
    n: int  # completions generated (0 for embeddings)
    admitted_at: float
    ended_at: float
    status: int = 0  # the response's status; 0: no response headers came
    first_byte_at: float | None = None
    streamed: bool = False  # the answer is (or was to be) a stream of events
    reported_total: int | None = None  # the backend's usage, prompt + completion
    counted_completion: int | None = None  # completion tokens Sluice counted from the body it read
    rate: float | None = None  # the model's learned decode rate per choice, tokens/s
    lost: bool = False  # no report of the end ever came (an access-log entry that never did)
    revoked: bool = False  # Sluice ended it to give a higher tier KV room


@dataclass(frozen=True, slots=True)
class Charge:
    tokens: int
    basis: Basis


def charge(e: SettleFacts) -> Charge:
    """What the tenant pays for a request that went to the backend (see the module docstring)."""
    if e.revoked and e.status == 0:
        return Charge(0, Basis.REVOKED)
    if e.lost:
        return Charge(e.prompt + e.completion_budget, Basis.LOST)
    if e.reported_total is not None:
        return Charge(e.reported_total, Basis.REPORTED)
    if e.status >= 400:
        return Charge(0, Basis.FAILED)
    if e.counted_completion is not None:
        return Charge(e.prompt + e.counted_completion, Basis.COUNTED)
    return Charge(
        e.prompt + completion_estimate(e.completion_budget, e.n, e.rate, generating_s(e)),
        Basis.ESTIMATED,
    )


def generating_s(e: SettleFacts) -> float:
    """How long the engine may have been generating for ``e`` (see ``charge``)."""
    if e.first_byte_at is None:
        return e.ended_at - e.admitted_at
    if e.streamed:
        return e.ended_at - e.first_byte_at
    return e.first_byte_at - e.admitted_at
