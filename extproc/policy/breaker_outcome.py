"""What a finished request tells its breakers: the ``Outcome``, from an upstream status or
from how the request settled.

What counts (``outcome_for_status``): ``FAILURE`` is any 5xx (503 included: the
backend says it cannot serve), a timeout, a transport error or an OOM. Every 4xx is
``CLIENT_ERROR`` and ignored, a backend 429 too: it is load, which the slot pool and
the KV watermark already answer, and one tenant's burst must not open the breaker for
everyone. ``CANCELLED`` (the client left) says nothing about the backend: ignored.
``TENANT_FAILURE`` is a failure blamed on its tenant alone (``tenant_breakers``): the
tenant's own breaker counts it, the backend's ignores it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from enum import StrEnum

from extproc.policy.reasons import Ending

__all__ = ["Outcome", "outcome_at_settle", "outcome_for_status"]


class Outcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"  # 5xx, timeout, transport error, OOM
    CLIENT_ERROR = "client_error"  # 4xx: not counted
    CANCELLED = "cancelled"  # client disconnected: not counted
    TENANT_FAILURE = "tenant_failure"  # a failure blamed on its tenant: not the backend's


def outcome_for_status(status: int) -> Outcome:
    """Classify an upstream HTTP status (timeouts and resets are ``FAILURE`` directly).

    5xx (503 included) is the backend's failure; 4xx (429 included) the client's.
    """
    if status >= 500:
        return Outcome.FAILURE
    return Outcome.CLIENT_ERROR if status >= 400 else Outcome.SUCCESS


def outcome_at_settle(how: Ending, status: int) -> Outcome:
    """What a request that settles ``how`` (extproc.request.settle) tells its breakers.

    A response that ended gives its status' outcome; an upstream error (reset, timeout) is
    a failure; anything else (refused, client gone, the stream reset before an answer)
    says nothing about the backend: ``CANCELLED`` gives a half-open probe's place back.
    """
    if how == Ending.END_OF_STREAM and status:
        return outcome_for_status(status)
    return Outcome.FAILURE if how == Ending.ERROR else Outcome.CANCELLED

