"""A request Sluice refuses: raised anywhere on the request path, answered by the adapter."""

from __future__ import annotations

from extproc.openai_api.errors import retry_after_headers
from extproc.policy import decision
from extproc.policy.reasons import Reason

__all__ = ["Refusal"]


class Refusal(Exception):
    """The reason (``x-sluice-reason``, the metric label, the status), the client's message,
    the OpenAI error ``code`` and ``param``, and headers to add (``Retry-After``, rate limits)."""

    def __init__(self, reason: Reason, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.code, self.param = reason, message, code or str(reason), param
        self.headers = headers or {}

    @classmethod
    def of(cls, d: decision.Reject) -> Refusal:
        """The refusal for the core's ``Reject`` decision."""
        headers = retry_after_headers(d.retry_after_s) if d.retry_after_s is not None else None
        return cls(d.reason, d.message, code=d.code, param=d.param, headers=headers)

    @classmethod
    def slots(cls, detail: str) -> Refusal:
        """Over the tenant's concurrency (its cap, in tokenizing or waiting): retry in a second."""
        return cls(Reason.SLOTS, f"Too many concurrent requests for this key ({detail}).",
                   code="rate_limit_exceeded", headers=retry_after_headers(1))
