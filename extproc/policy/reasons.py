"""Why a request was refused, and how a stream ended: the names clients, metrics and breakers see.

A ``Reason`` is what ``x-sluice-reason`` and the ``reason`` metric label say; each
carries the HTTP status and the OpenAI error type it is answered with, on its own line,
so the whole table is one grep. An ``Ending`` is how a stream left Sluice; settle bills,
and the breakers judge, by it.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["CHARGED", "Cause", "Ending", "Reason"]

_INVALID = "invalid_request_error"
_RATE = "rate_limit_exceeded"
_SERVER = "server_error"


class Reason(StrEnum):
    """Why a request is refused."""

    status: int
    error_type: str

    def __new__(cls, value: str, status: int, error_type: str) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.error_type = error_type
        return member

    UNKNOWN_KEY = "unknown_key", 401, _INVALID  # malformed: answered by Envoy (extproc.envoy.edge)
    # a body in a Content-Encoding Sluice did not decode
    UNSUPPORTED_ENCODING = "unsupported_encoding", 415, _INVALID
    UNKNOWN_PATH = "unknown_path", 404, _INVALID
    UNKNOWN_MODEL = "unknown_model", 404, _INVALID
    BODY_TOO_LARGE = "body_too_large", 413, _INVALID
    BAD_REQUEST = "bad_request", 400, _INVALID
    CONTEXT_LENGTH = "context_length", 400, _INVALID
    TOO_LARGE_FOR_BACKEND = "too_large_for_backend", 400, _INVALID
    TOKENIZER_FAILED = "tokenizer_failed", 400, _INVALID
    TPM = "tpm", 429, _RATE
    TPM_REQUEST_TOO_LARGE = "tpm_request_too_large", 429, _RATE
    RPM = "rpm", 429, _RATE
    SLOTS = "slots", 429, _RATE
    QUEUE_FULL = "queue_full", 429, _RATE
    BUDGET = "budget", 429, _RATE  # the tenant's budget for this period is spent (docs/budgets.md)
    BUDGET_REQUEST_TOO_LARGE = "budget_request_too_large", 429, _RATE  # more than a whole period's budget
    QUEUE_TIMEOUT = "queue_timeout", 503, _SERVER
    BREAKER_OPEN = "breaker_open", 503, _SERVER
    TENANT_BREAKER_OPEN = "tenant_breaker_open", 503, _SERVER
    OVERLOADED = "overloaded", 503, _SERVER
    STATE_STORE_DOWN = "state_store_down", 503, _SERVER
    NO_ENDPOINT = "no_endpoint", 503, _SERVER  # picker mode: nothing the gateway may route to is ready
    # Admitted, then revoked before any answer to give a higher tier KV room
    # (extproc.policy.revoke).
    REVOKED = "revoked", 503, _SERVER
    # Answered by Envoy itself (extproc.envoy.replies), in the same shape.
    GATEWAY_UNAVAILABLE = "gateway_unavailable", 503, _SERVER  # extproc unreachable, failing or silent
    REQUEST_TIMEOUT = "request_timeout", 408, _INVALID  # a client too slow to send its request
    EDGE_RATE_LIMITED = "edge_rate_limited", 429, _RATE  # a key or address over its edge rate
    # The client left while its request waited: nothing is answered (nginx's 499 by name).
    CLIENT_GONE = "client_gone", 499, _INVALID


# Refused after the prompt was counted, for a reason retrying cannot fix: the counting
# is charged to the tenant's TPM budget, so a flood of oversized prompts pays for the
# tokenizer time it takes from everyone else.
CHARGED = frozenset({Reason.CONTEXT_LENGTH, Reason.TOO_LARGE_FOR_BACKEND, Reason.TPM_REQUEST_TOO_LARGE,
                     Reason.TOKENIZER_FAILED})


class Cause(StrEnum):
    """Why a request cannot have a slot now: internal (``Denied.reason``, ``Queue.cause``);
    the client sees the ``Reason`` it leads to."""

    KV_EXHAUSTED = "kv_exhausted"
    SLOTS_EXHAUSTED = "slots_exhausted"
    SLOTS_TENANT_CAP = "slots_tenant_cap"
    QUEUE_REMOVED = "queue_removed"  # its tier left the policy, or its queue shrank below it


class Ending(StrEnum):
    """How a stream left Sluice: what settle bills by and the breakers hear."""

    END_OF_STREAM = "end_of_stream"  # the response ended (successfully or not: see its status)
    REJECTED = "rejected"  # Sluice answered the request itself; nothing reached a backend
    DISCONNECT = "disconnect"  # the ext_proc stream ended before the response did: the client left
    ERROR = "error"  # Sluice's own handling of the stream failed
    # response_processing access_log: the request's access-log entry never came within the
    # route's timeout and a margin (extproc.request.log_settle); it keeps its pre-charge
    EXPIRED = "expired"
    REVOKED = "revoked"  # ended by Sluice to give a higher tier KV room: billed what it produced
