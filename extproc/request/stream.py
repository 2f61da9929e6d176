"""The ext_proc adapter for Sluice's own Envoy: one HTTP stream's messages in, answers out.

One method per phase: request headers (``intake``: key, path, size) → request body
(``intake`` then ``Admission.admit``: the verdict, the pre-charge, the slot) → response
headers → the response body or trailers, feeding the ``Settlement``. This module only
maps between ext_proc messages and those; the decisions are theirs. Every way a stream
can end (end of stream, upstream error, client disconnect, Envoy resetting the ext_proc
stream, a message timeout, a refusal after admission) reaches ``settle()``, which gives
back what the request held exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import usage_record
from extproc.envoy.headers import UPSTREAM_ATTRIBUTE
from extproc.openai_api.errors import budget_headers, error_body, ratelimit_headers
from extproc.openai_api.usage import JSONTracker, SSETracker
from extproc.policy.reasons import Ending, Reason
from extproc.policy.schema import Limits, Tenant
from extproc.request import intake, upstream
from extproc.request.admission import Admission, Wait
from extproc.request.refusal import Refusal
from extproc.request.repick import served_elsewhere
from extproc.request.revoking import Revoker
from extproc.request.settle import Settlement
from extproc.request.ticket import Ticket
from extproc.runtime.metrics import NO_TENANT
from extproc.runtime.runtime import Runtime
from extproc.runtime.usage_history import NO_MODEL
from extproc.wire import messages as msg
from extproc.wire.peer import PeerStream

log = logging.getLogger("sluice.stream")

__all__ = ["StreamProcessor"]

REQUEST_ID = "x-request-id"  # Envoy's, on every request it forwards: the engine sees the same id
REQUEST_HEADERS = frozenset({":path", ":method", "content-length", "content-encoding", REQUEST_ID,
                             *intake.KEY_HEADERS})
# Kinds whose response a revocable tier's request streams through Sluice (to end it with an
# error event).
REVOCABLE_KINDS = frozenset({"chat", "completions", "responses"})
RESPONSE_HEADERS = frozenset({":status", "content-type"})
_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class StreamProcessor:
    def __init__(self, rt: Runtime, peer: PeerStream) -> None:
        self.rt = rt
        self.peer = peer
        self.policy = rt.policy  # pinned for the stream's lifetime
        self.arrived_s = rt.clock()  # the stream starts with the request's headers
        self.tenant: Tenant | None = None
        self.limits: Limits | None = None
        self.kind: str | None = None
        self.admission: Admission | None = None
        self.settlement: Settlement | None = None  # once the tenant is known
        self.finished = False  # an immediate response ended the exchange
        self.reads_body = (
            False  # the response body passes through Sluice (streamed, or this request's mode)
        )
        # while the request could be revoked (extproc.request.revoking)
        self.revoker: Revoker | None = None

    @property
    def ticket(self) -> Ticket | None:
        return None if self.settlement is None else self.settlement.ticket

    @property
    def settled(self) -> bool:
        return self.settlement is None or self.settlement.settled

    def settle(self, how: Ending) -> None:
        """Release what the request holds; idempotent, called on every exit path."""
        if self.settlement is not None:
            self.settlement.settle(how)

    # -- dispatch -----------------------------------------------------------
    # One synchronous call per message; only the request body (token counting off the
    # event loop, a wait in the admission queue) is awaited, once per request.
    def handle(self, phase: str, request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """Answer a message of any phase but the request body (see ``handle_body``)."""
        t0 = time.perf_counter()
        try:
            response = self._dispatch(phase, request)
        except Refusal as rej:
            response = self._refused(rej)
        if response is not None:
            self._timed(phase, t0)
        return response

    async def handle_body(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The request body's answers: a wait hint first when the request must wait."""
        t0 = time.perf_counter()
        try:
            async for response in self.on_request_body(request.request_body):
                # Timed up to the answer: not the time gRPC takes to send it.
                self._timed("request_body", t0)
                yield response
                t0 = time.perf_counter()
        except Refusal as rej:
            response = self._refused(rej)
            if response is not None:
                self._timed("request_body", t0)
                yield response

    def _timed(self, phase: str, t0: float) -> None:
        self.rt.metrics.phase(phase, time.perf_counter() - t0)

    def _refused(self, rej: Refusal) -> pb.ProcessingResponse | None:
        """The answer to a refusal; anything held after a pre-charge goes back first."""
        self.finished = True
        self.settle(Ending.REJECTED)
        if rej.reason is Reason.CLIENT_GONE:
            return None  # never reached the backend: nothing to bill, nobody to answer
        s = self.settlement
        if s is not None:
            s.charge_refused(rej.reason)
        self.rt.metrics.rejected(rej.reason, rej.reason.status, self.tenant.name if self.tenant else NO_TENANT)
        headers = {"x-sluice-reason": str(rej.reason), **rej.headers}
        if self.tenant is not None:
            # Once the key is known every answer says where it stands, and goes into its history.
            if "x-ratelimit-limit-tokens" not in headers:
                headers.update(self._rate_headers())
            if "x-sluice-budget-period" not in headers:
                headers.update(self._budget_headers())
            self.rt.usage.refused(self.tenant.name, self._model_label(), rej.reason, self.rt.wall())
        return msg.immediate(rej.reason.status, error_body(rej.message, rej.reason.error_type, rej.code, rej.param),
                             headers, f"sluice_{rej.reason}")

    def _dispatch(self, phase: str, request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        if phase == "response_body":
            s = self.settlement
            if s is not None and s.tracker is None and s.admitted and not s.settled:
                self._start_response(request, s)
            return self.on_response_body(request.response_body)
        if phase == "request_headers":
            return self.on_request_headers(request.request_headers)
        if phase == "response_headers":
            return self.on_response_headers(request)
        if phase == "response_trailers":
            return self.on_response_trailers(request)
        if phase.endswith("trailers"):
            return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})
        return None

    def _rate_headers(self) -> dict[str, str]:
        assert self.tenant is not None and self.limits is not None
        tv, rv = self.rt.state.view(self.tenant.name, self.limits, self.rt.clock())
        return ratelimit_headers(tv, rv)

    def _budget_headers(self) -> dict[str, str]:
        """The tenant's budget standing, if it has a budget (docs/budgets.md)."""
        assert self.tenant is not None
        budget = self.policy.budget(self.tenant)
        if budget is None:
            return {}
        wall = self.rt.wall()
        return budget_headers(self.rt.budgets.view(self.tenant.name, budget, wall), wall)

    def _model_label(self) -> str:
        """The refused request's model, when it named one the policy serves (a bounded label)."""
        req = self.settlement.req if self.settlement is not None else None
        return req.model if req is not None and req.model in self.policy.by_model else NO_MODEL

    # -- request side -------------------------------------------------------
    def on_request_headers(self, h: pb.HttpHeaders) -> pb.ProcessingResponse:
        headers = msg.header_map(h, REQUEST_HEADERS)
        tenant = self.tenant = intake.tenant_of(self.policy, headers)
        self.limits = self.policy.limits(tenant)
        got = intake.route(self.policy, tenant, headers, h.end_of_stream)
        if isinstance(got, intake.Models):
            self.rt.metrics.bypassed(tenant.name, "models")
            self.finished = True
            return msg.immediate(200, got.body, {**self._rate_headers(), **self._budget_headers()}, "sluice_models")
        if got.kind is None:
            self.rt.metrics.bypassed(tenant.name, "passthrough")
            fwd = upstream.passthrough(self.rt, self.policy, tenant, got.clean_path)
            return msg.headers_response("request_headers", fwd.set_headers, fwd.remove_headers,
                                        mode_override=msg.SKIP_REST)
        self.kind = got.kind
        self.settlement = Settlement(self.rt, tenant, self.limits, self.policy.tiers[tenant.tier],
                                     self.arrived_s, headers.get(REQUEST_ID, ""))
        self.admission = Admission(self.rt, self.policy, tenant, self.limits, self.peer, self.settlement)
        # A key that cannot pay for one token is refused before its body is even sent here.
        self.admission.precheck(self.rt.clock())
        gw = self.policy.gateway
        # Envoy's usage filter reads neither the Responses API's usage nor an embeddings body's.
        # A revocable tier's response is read chunk by chunk too, so a revoked stream can end with
        # an error event (extproc.request.revoking): what that costs is one message per chunk.
        revocable = got.kind in REVOCABLE_KINDS and self.policy.tiers[tenant.tier].revocable
        read_body = (got.kind in ("responses", "embeddings") or revocable) \
            and gw.response_processing != "streamed"
        self.reads_body = read_body or gw.response_processing == "streamed"
        # The response side is off in the filter's static mode: turned on here, for this request.
        mode = msg.READ_RESPONSE_BODY if read_body else msg.RESPONSE_MODES[gw.response_processing]
        new_path = {":path": got.clean_path} if got.clean_path else {}
        return msg.headers_response("request_headers", new_path, mode_override=mode)

    async def on_request_body(self, b: pb.HttpBody) -> AsyncIterator[pb.ProcessingResponse]:
        assert self.tenant is not None and self.kind is not None
        assert self.admission is not None and self.settlement is not None
        req, backend, model = intake.check_body(self.policy, self.kind, b.body)
        ticket = None
        async for step in self.admission.admit(req, backend, model):
            if isinstance(step, Wait):
                yield pb.ProcessingResponse(override_message_timeout=msg.duration_from(step.seconds))
            else:
                ticket = step
        assert ticket is not None
        self._track(ticket)
        fwd = upstream.forward(self.rt, self.policy, self.tenant, req, ticket)
        self.settlement.forwarded()
        # Response headers decided now travel as dynamic metadata (see extproc.envoy.routes).
        yield msg.body_response("request_body", fwd.body, fwd.set_headers, fwd.remove_headers,
                                clear_route_cache=True, metadata={msg.METADATA_NAMESPACE: fwd.response_headers})

    def _track(self, ticket: Ticket) -> None:
        """A request on a backend where a tier may take KV room back can be revoked: say so."""
        hold, be, s = ticket.hold, ticket.backend_state, self.settlement
        if hold is None or not be.kv_shares or s is None:
            return
        self.revoker = Revoker(self.rt, s, s.request_id, self.reads_body)
        be.shares.revocations.track(
            hold.grant.id, hold.grant.tier, hold.kv, hold.endpoint, ticket.admitted_at, self.revoker
        )

    # -- response side ------------------------------------------------------
    def _start_response(self, request: pb.ProcessingRequest, s: Settlement) -> None:
        """The first response-body message (``streamed``): response headers are skipped, so
        the status comes as an attribute; the body is read for its usage from here on."""
        if s.first_byte_s is None:
            code = msg.attribute(request, "response.code")
            s.responded(int(code) if isinstance(code, (int, float)) else 200, self.rt.clock())
            self._follow_served(request, s.first_byte_s or 0.0)
        req = s.req
        assert req is not None
        responses = req.kind == "responses"
        if req.stream and s.status < 400:
            s.watch(SSETracker(drop_usage_chunk=not responses and not req.usage_requested, responses=responses))
        else:
            s.watch(JSONTracker(responses=responses, tail=req.kind == "embeddings"))

    def _follow_served(self, request: pb.ProcessingRequest, now: float) -> None:
        """The first response message names who served (``upstream.address``): after Envoy
        re-picked on a connect failure the hold follows (extproc.request.repick). A settled
        request holds nothing any more, so there is nothing to move."""
        served = msg.attribute(request, UPSTREAM_ATTRIBUTE)
        if isinstance(served, str) and self.ticket is not None:
            served_elsewhere(self.ticket, served, self.rt.metrics, now)

    def on_response_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """response_processing usage_trailers: status and first byte; the body bypasses us."""
        s = self.settlement
        h = request.response_headers
        headers = msg.header_map(h, RESPONSE_HEADERS)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        if s is None:
            return _HEADERS_CONTINUE
        s.responded(status, self.rt.clock(), "text/event-stream" in headers.get("content-type", ""))
        self._follow_served(request, s.first_byte_s or 0.0)  # before any settle below
        # Envoy synthesizes trailers only for a successful response it read the usage
        # of: an error response has nothing to bill and its end is not waited for.
        if s.admitted and (h.end_of_stream or status >= 400):
            s.settle(Ending.END_OF_STREAM)
        return _HEADERS_CONTINUE

    def on_response_trailers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """The one message at a clean end of a response, carrying Envoy's usage record."""
        s = self.settlement
        if s is not None:
            s.usage_record(usage_record.usage_from_metadata(request))
            if s.tracker is not None and not s.settled:
                s.tracker.feed(b"", True)  # a body read here ends with the trailers, not a last chunk
            s.settle(Ending.END_OF_STREAM)
        return _TRAILERS_CONTINUE

    def on_response_body(self, b: pb.HttpBody) -> pb.ProcessingResponse:
        s = self.settlement
        replacement = None
        if s is not None and s.tracker is not None and not s.settled:
            replacement = s.tracker.feed(b.body, b.end_of_stream)
        rv = self.revoker
        if rv is not None and not b.end_of_stream:
            # Revoked mid-stream: this chunk goes on with the error event after it, then the end.
            ended = rv.end_chunk(b.body if replacement is None else replacement)
            if ended is not None:
                self.finished = True
                return msg.body_response("response_body", ended)
        if b.end_of_stream:
            self.settle(Ending.END_OF_STREAM)
        if replacement is None:
            return msg.continue_response_body()
        return msg.body_response("response_body", replacement)

