"""The ext_proc adapter for Sluice's own Envoy: one HTTP stream's messages in, answers out.

One method per phase: request headers (``intake``: key, path, size) → request body
(``intake`` then ``Admission.admit``: the verdict, the pre-charge, the slot) → response
headers → the response body or trailers, feeding the ``Settlement``. This module only
maps between ext_proc messages and those; the decisions are theirs. Every way a stream
can end (end of stream, upstream error, client disconnect, Envoy resetting the ext_proc
stream, a message timeout, a refusal after admission) reaches ``settle()``, which gives
back what the request held exactly once.

The request side is one round trip (``extproc.envoy.extproc_filter``): the answer to the
request headers waits until the STREAMED body is complete, then carries every mutation,
followed by one answer per body chunk. An Envoy configured the older way (body
BUFFERED, said by the first message's ``protocol_config``) gets its headers answered at
once and the mutations with the body, as before. Under ``response_processing:
access_log`` the stream ends once the request is answered, and a forwarded request
settles when its access-log entry comes (``extproc.request.log_settle``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import usage_record
from extproc.envoy.headers import SETTLE_KEY, UPSTREAM_ATTRIBUTE
from extproc.openai_api.errors import budget_headers, error_body, ratelimit_headers
from extproc.openai_api.usage import JSONTracker, SSETracker
from extproc.policy.reasons import Ending, Reason
from extproc.policy.schema import Limits, Tenant
from extproc.request import intake, upstream
from extproc.request.admission import Admission, Wait
from extproc.request.log_settle import LogSettles, expires_after_s
from extproc.request.refusal import Refusal
from extproc.request.repick import served_elsewhere
from extproc.request.revoking import Revoker, track
from extproc.request.settle import Settlement
from extproc.request.ticket import Ticket
from extproc.runtime.metrics import NO_TENANT
from extproc.runtime.runtime import Runtime
from extproc.runtime.usage_history import NO_MODEL
from extproc.wire import forward_answer
from extproc.wire import messages as msg
from extproc.wire.peer import PeerStream

log = logging.getLogger("sluice.stream")

__all__ = ["StreamProcessor"]

REQUEST_ID = "x-request-id"  # Envoy's, on every request it forwards: the engine sees the same id
REQUEST_HEADERS = frozenset({":path", ":method", "content-length", "content-encoding", REQUEST_ID,
                             *intake.KEY_HEADERS})
# Kinds whose response a revocable tier's request streams through Sluice (to end it with an
# error event).
RESPONSE_HEADERS = frozenset({":status", "content-type"})
_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class StreamProcessor:
    def __init__(self, rt: Runtime, peer: PeerStream, log_settles: LogSettles | None = None) -> None:
        self.rt = rt
        self.peer = peer
        self.log_settles = log_settles  # where a forwarded request waits for its access-log entry
        self.policy = rt.policy  # pinned for the stream's lifetime
        self.arrived_s = rt.clock()  # the stream starts with the request's headers
        self.tenant: Tenant | None = None
        self.limits: Limits | None = None
        self.kind: str | None = None
        self.admission: Admission | None = None
        self.settlement: Settlement | None = None  # once the tenant is known
        self.finished = False  # an immediate response ended the exchange
        # The request headers' answer waits for the body (Envoy sends the body without
        # waiting for it); the body's chunks, and the path the headers' answer will set.
        self.deferred = False
        self.chunks: list[bytes] = []
        self.body_bytes = 0
        self.new_path: dict[str, str] = {}
        self.awaiting_log: str | None = None  # the access-log settle id, once forwarded
        self.mode: msg.PM | None = None  # the whole processing mode this request needs
        # Envoy's config sends nothing of the response (protocol_config), as access_log
        # needs: a gateway's own config may still stream it, and then the stream settles.
        self.quiet_response = False
        self.saw_response = False
        # the response body passes through Sluice (its mode streams it), and the handle that
        # revokes the request while it can be (extproc.request.revoking)
        self.reads_body = False
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

    def end(self, how: Ending) -> None:
        """The ext_proc stream is over (``how``: as the server saw it end). A request waiting
        for its access-log entry settles from the entry, or by expiry: under ``access_log``
        the stream ends once the request is answered, and a client that leaves later shows
        in the entry (flag DC)."""
        if self.awaiting_log is None or self.saw_response:
            self.settle(how)
            if self.awaiting_log is not None and self.log_settles is not None:
                self.log_settles.forget(self.awaiting_log)

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
        if response is not None or phase == "request_headers":  # a deferred answer: timed too
            self._timed(phase, t0)
        return response

    async def handle_body(self, request: pb.ProcessingRequest) -> AsyncIterator[msg.Answer]:
        """A request-body message's answers: none until the body is complete (its chunks are
        answered together, after the headers), a wait hint first when the request must wait."""
        t0 = time.perf_counter()
        b = request.request_body
        if self.kind is None or self.finished:
            # A path Sluice does not read (its route sends no body; an older Envoy config would).
            yield msg.continue_request_body()
            return
        # One observation per body: the time up to each answer, summed over them (not the
        # time gRPC takes to send one); a chunk that is only kept is not timed.
        spent = 0.0
        try:
            if self.deferred and not self._take_chunk(b):
                return
            raw = b"".join(self.chunks) if self.deferred else b.body
            async for response in self.on_request_body(raw):
                spent += time.perf_counter() - t0
                yield response
                t0 = time.perf_counter()
        except Refusal as rej:
            response = self._refused(rej)
            if response is not None:
                spent += time.perf_counter() - t0
                yield response
        if spent:
            self.rt.metrics.phase("request_body", spent)

    def _take_chunk(self, b: pb.HttpBody) -> bool:
        """Keep one chunk of a STREAMED body; True once the body is complete.

        Over the cap the request is refused once the body ends (read whole, an HTTP/1.1
        client reads the 413), or sooner if it keeps coming: Envoy stops reading from the
        client when the chunks it holds for their answers fill its buffer, so waiting longer
        would only end in its message timeout."""
        self.chunks.append(b.body)
        self.body_bytes += len(b.body)
        cap = self.policy.gateway.max_body_bytes
        if self.body_bytes > cap:
            self.chunks = [b""]  # only counted from here on
            if b.end_of_stream:
                raise Refusal(Reason.BODY_TOO_LARGE, f"Request body is {self.body_bytes} bytes; the limit is {cap}.")
            if self.body_bytes > intake.chunked_limit(cap):
                raise Refusal(Reason.BODY_TOO_LARGE,
                              f"Request body is more than {self.body_bytes} bytes; the limit is {cap}.")
        return b.end_of_stream

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
        if phase.startswith("response"):
            self.saw_response = True
        if phase == "response_body":
            s = self.settlement
            if s is not None and s.tracker is None and s.admitted and not s.settled:
                self._start_response(request, s)
            return self.on_response_body(request.response_body)
        if phase == "request_headers":
            # Envoy sends the body without waiting for this answer: it is given with the body's.
            config = request.protocol_config
            can_defer = config.send_body_without_waiting_for_header_response
            self.quiet_response = config.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
            return self.on_request_headers(request.request_headers, can_defer)
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
    def on_request_headers(self, h: pb.HttpHeaders, can_defer: bool = False) -> pb.ProcessingResponse | None:
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
            # The route of a path Sluice does not read sends it nothing more (extproc_filter.headers_only).
            self.finished = True
            return msg.headers_response("request_headers", fwd.set_headers, fwd.remove_headers,
                                        mode_override=msg.SKIP_REST)
        self.kind = got.kind
        self.settlement = Settlement(self.rt, tenant, self.limits, self.policy.tiers[tenant.tier],
                                     self.arrived_s, headers.get(REQUEST_ID, ""))
        self.admission = Admission(self.rt, self.policy, tenant, self.limits, self.peer, self.settlement)
        # A key that cannot pay for one token is refused before its body is even read here.
        self.admission.precheck(self.rt.clock())
        # The response side this request needs (extproc.wire.messages.response_mode): the
        # route it matched says it to Envoy 1.40; the answer carries it too, for an Envoy
        # that takes a mode_override (one configured without the one-round-trip request side).
        self.mode = msg.response_mode(got.kind, self.policy.gateway.response_processing)
        self.reads_body = self.mode.response_body_mode == msg.PM.STREAMED
        new_path = {":path": got.clean_path} if got.clean_path else {}
        self._read_on(headers)
        if can_defer:
            self.deferred, self.new_path = True, new_path
            return None
        return msg.headers_response("request_headers", new_path, mode_override=self.mode)

    def _read_on(self, headers: dict[str, str]) -> None:
        """The headers passed: the body comes next and is read whole, so its transport may
        let all of it come at once (a stream's first window is small: extproc.wire.h2grpc)."""
        if self.peer is not None:  # None in process, where nothing is sent
            self.peer.expect(intake.body_ahead(headers, self.policy.gateway))

    async def on_request_body(self, raw: bytes) -> AsyncIterator[msg.Answer]:
        """The complete body: checked, admitted; a wait hint first when the request must
        wait, then the answers that send it on (``_forward``)."""
        assert self.tenant is not None and self.kind is not None
        assert self.admission is not None and self.settlement is not None
        req, backend, model = intake.check_body(self.policy, self.kind, raw)
        ticket = None
        async for step in self.admission.admit(req, backend, model):
            if isinstance(step, Wait):
                yield pb.ProcessingResponse(override_message_timeout=msg.duration_from(step.seconds))
            else:
                ticket = step
        assert ticket is not None
        self.revoker = track(self.rt, ticket, self.settlement, self.reads_body, self.mode)
        fwd = upstream.forward(self.rt, self.policy, self.tenant, req, ticket)
        for answer in self._forward(fwd, raw):
            yield answer

    def _forward(self, fwd: upstream.Forward, raw: bytes) -> list[msg.Answer]:
        """The answers that send an admitted request on: the headers' (deferred) with every
        mutation, then one per body chunk; or, to an Envoy that buffered the body, the
        body's with the mutations."""
        s = self.settlement
        assert s is not None
        gw = self.policy.gateway
        set_headers = {**fwd.set_headers, **self.new_path}
        if self.deferred:
            # STREAMED: Envoy keeps content-length (allow_content_length_header) as the
            # client sent it, or none for a chunked upload; the body's length is known now.
            set_headers["content-length"] = str(len(fwd.body if fwd.body is not None else raw))
        # Response headers decided now travel as dynamic metadata (see extproc.envoy.routes).
        out = dict(fwd.response_headers)
        if (self.log_settles is not None and gw.response_processing == "access_log"
                and self.kind not in msg.READS_BODY and self.quiet_response):
            # Its settle waits for Envoy's access-log entry, which this id ties to it.
            expires = self.rt.clock() + expires_after_s(gw.response_timeout_s)
            self.awaiting_log = out[SETTLE_KEY] = self.log_settles.register(s, expires)
        s.forwarded()
        metadata = {msg.METADATA_NAMESPACE: out}
        if not self.deferred:
            return [msg.body_response("request_body", fwd.body, set_headers, fwd.remove_headers,
                                      clear_route_cache=True, metadata=metadata)]
        chunks, self.chunks = len(self.chunks), []
        return [forward_answer.request_headers(set_headers, fwd.remove_headers, metadata, self.mode),
                *msg.request_chunk_answers(chunks, fwd.body)]

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

