"""One admitted request's side of revocation: how far it got, and how it is ended.

The backend decides whom to revoke (``extproc.backends.shares.TierShares.reclaim``, the pure
``extproc.policy.revoke``); a ``Revoker`` is the handle it calls
(``extproc.backends.revocation.Revocable``). Revoking only records the order and wakes the
stream's loop (``extproc.service.server``), which answers Envoy on the ext_proc stream the
request still holds open (measured on Envoy 1.40: an ``ImmediateResponse`` is accepted out
of turn, and Envoy then resets the upstream request, which the engine sees as a disconnect
and aborts):

* no response headers yet: an ``ImmediateResponse`` 503 ``revoked`` with ``Retry-After``;
  the request settles ``revoked``, unbilled;
* streaming (a revocable tier's response body is read chunk by chunk): the next chunk goes
  on with an OpenAI-shaped error event after it, then an ``ImmediateResponse`` ends the
  stream; it settles ``revoked``, billed what it generated. If no chunk comes within
  ``CHUNK_WAIT_S`` (the engine stalled), the ``ImmediateResponse`` alone ends it.
"""

from __future__ import annotations

import asyncio
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.backends.revocation import Progress
from extproc.openai_api.errors import error_body, retry_after_headers
from extproc.openai_api.usage import SSETracker
from extproc.policy.decode_rate import completion_estimate
from extproc.policy.reasons import Ending, Reason
from extproc.request.settle import Settlement
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime
from extproc.wire import messages as msg

__all__ = ["CHUNK_WAIT_S", "Revoker", "track"]

CHUNK_WAIT_S = 0.5


class Revoker:
    """Implements ``extproc.backends.revocation.Revocable`` for one stream's settlement."""

    def __init__(
        self, rt: Runtime, settlement: Settlement, request_id: str, reads_body: bool
    ) -> None:
        self.rt, self.settlement, self.request_id, self.reads_body = (
            rt,
            settlement,
            request_id,
            reads_body,
        )
        self.order: tuple[str, float] | None = None  # (message, retry-after s) once revoked
        self.wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = False  # the ending was sent
        self.pending: pb.ProcessingResponse | None = (
            None  # what ends the stream after its last chunk
        )

    @property
    def due(self) -> bool:
        """Revoked and not yet ended."""
        return self.order is not None and not self.done and not self.settlement.settled

    # -- Revocable ---------------------------------------------------------------------------
    def progress(self, now: float) -> Progress:
        s = self.settlement
        generated = len(s.tracker.texts) if isinstance(s.tracker, SSETracker) else 0
        if (
            not generated
            and s.first_byte_s is not None
            and s.ticket is not None
            and s.req is not None
        ):
            # As settle would charge it if it ended now: with no rate learned yet, the whole
            # completion budget (a stream is not taken for cheap to revoke for want of a rate).
            generated = completion_estimate(
                max(0, s.reserved - s.prompt_tokens), s.req.n,
                self.rt.decode_rates.rate(s.ticket.model.name), now - s.first_byte_s,
            )
        return Progress(s.status != 0, s.prompt_tokens + generated, generated)

    def revoke(self, message: str, retry_after_s: float) -> None:
        if self.order is None:
            self.order = (message, retry_after_s)
            if not self.wake.done():
                self.wake.set_result(None)

    # -- the ending ----------------------------------------------------------------------------
    def answer_now(self) -> pb.ProcessingResponse | None:
        """Called when the backend revoked the request: the answer to send now, if any (None:
        the next chunk carries the error event, ``end_chunk``)."""
        if not self.due:
            return None
        s = self.settlement
        if s.status == 0:  # no answer yet: a 503 replaces it, unbilled
            return self._end(self._refusal())
        streams = isinstance(s.tracker, SSETracker) or (
            s.tracker is None and self.reads_body and s.req is not None and s.req.stream
        )
        if not streams:  # nothing passes through Sluice to carry an error event: end it
            return self._end(self._reset())
        return None

    def end_chunk(self, body: bytes) -> bytes | None:
        """A revoked stream's next chunk: the chunk with the error event after it (and the end
        left ``pending``), or None when it is not revoked."""
        if not self.due:
            return None
        self.pending = self._end(self._reset())
        return body + self._error_event()

    def late(self) -> pb.ProcessingResponse | None:
        """No chunk came within CHUNK_WAIT_S of the revocation: end the stream without its event."""
        return self._end(self._reset()) if self.due else None

    def _end(self, response: pb.ProcessingResponse) -> pb.ProcessingResponse:
        self.done = True
        self.settlement.settle(Ending.REVOKED)
        return response

    def _refusal(self) -> pb.ProcessingResponse:
        assert self.order is not None
        message, retry = self.order
        r = Reason.REVOKED
        headers = {"x-sluice-reason": str(r), **retry_after_headers(retry)}
        self.rt.metrics.rejected(
            r, r.status, None
        )  # counted as a refusal; the request was admitted
        return msg.immediate(
            r.status, error_body(message, r.error_type, str(r)), headers, f"sluice_{r}"
        )

    def _error_event(self) -> bytes:
        assert self.order is not None
        message, _ = self.order
        r = Reason.REVOKED
        err = {"error": {"message": message, "type": r.error_type, "param": None, "code": str(r)}}
        return b"data: " + json.dumps(err).encode() + b"\n\n"

    @staticmethod
    def _reset() -> pb.ProcessingResponse:
        """What ends an answered stream: Envoy cannot send a new status, so it resets it (and
        the upstream)."""
        return msg.immediate(
            Reason.REVOKED.status, b"", {"x-sluice-reason": str(Reason.REVOKED)}, "sluice_revoked"
        )


def track(rt: Runtime, ticket: Ticket, s: Settlement | None, reads_body: bool,
          mode: msg.PM | None) -> Revoker | None:
    """A request on a backend where a tier may take KV room back can be revoked: its handle,
    given to the backend; None where it cannot be."""
    hold, be = ticket.hold, ticket.backend_state
    if hold is None or not be.kv_shares or s is None:
        return None
    if mode == msg.REQUEST_ONLY:
        # Nothing of the response comes here (access_log): the ext_proc stream ends once
        # the request is forwarded, and there is nothing left to end it on.
        return None
    revoker = Revoker(rt, s, s.request_id, reads_body)
    be.shares.revocations.track(
        hold.grant.id, hold.grant.tier, hold.kv, hold.endpoint, ticket.admitted_at, revoker
    )
    return revoker
