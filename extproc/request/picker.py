"""The ext_proc adapter for a gateway's Envoy: Sluice as an Inference Extension endpoint picker.

The gateway's Envoy, not Sluice, decides the processing modes (``extproc.envoy.picker_protocol``
names who sends what). The decisions are the same as on Sluice's own Envoy: ``intake`` reads
the request, ``Admission.admit`` is the one entry point, ``upstream`` says what goes on (with
the picker's ``destination``), the ``Settlement`` is the one exit. This adapter only shapes
the wire:

* ``FULL_DUPLEX_STREAMED`` request body (GIE's, llm-d-router's, AI Gateway's and Istio's
  default): the request-headers answer is held until the body has arrived, because the
  headers answer carries the routing. Then, in the order Envoy requires (headers, body,
  trailers), the headers answer with the endpoint in ``x-gateway-destination-endpoint``
  and ``envoy.lb`` metadata and ``clear_route_cache``, and the body sent back (rewritten
  where Sluice caps ``max_tokens`` or asks for the usage chunk).
* ``BUFFERED`` request body (AI Gateway's ``processing-body-mode: buffered``): Envoy waits
  for the headers answer before it sends the body, so the headers are answered at once and
  the routing rides on the body answer, as on Sluice's own path.
* Response side: the headers bring the status and the first byte (and, where the gateway
  forwards it, who served: the hold follows, as on a re-pick); every streamed chunk is
  fed to the usage tracker and sent back, the usage chunk Sluice asked for removed for a
  client that did not ask; the end of the body, the trailers, or the stream's end settle
  exactly once. Headers decided on the request side (``x-ratelimit-*``, a budget's
  ``x-ratelimit-*-budget-*``, ``x-sluice-degraded``) are added to the response headers directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.backends.inference_pool import OBJECTIVE_HEADERS
from extproc.backends.resolve import resolve
from extproc.envoy import picker_protocol as pp
from extproc.envoy import usage_record
from extproc.openai_api.usage import JSONTracker, SSETracker, UsageOnlyTracker
from extproc.policy.placement import pick
from extproc.policy.reasons import Ending, Reason
from extproc.policy.schema import Tenant
from extproc.request import intake, upstream
from extproc.request.admission import Admission, Wait
from extproc.request.refusal import Refusal
from extproc.request.repick import served_elsewhere
from extproc.request.settle import Settlement
from extproc.request.stream import REQUEST_HEADERS, RESPONSE_HEADERS, StreamProcessor
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime
from extproc.wire import messages as msg
from extproc.wire.peer import PeerStream

__all__ = ["Answer", "PickerOptions", "PickerStream"]

Answer = msg.Answer

_TRAILERS = {"request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
             "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse())}
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_BODY_CONTINUE = {"request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
                  "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse())}
_PICKER_REQUEST_HEADERS = REQUEST_HEADERS | frozenset(OBJECTIVE_HEADERS)
# Sluice's own Envoy routes on this; a gateway's route has chosen the pool already.
_OWN_ONLY = frozenset({"x-sluice-backend"})


@dataclass(frozen=True)
class PickerOptions:
    # Name the second choice after the pick (``ip:port,ip:port``). Only for gateways whose pool
    # honours a list (Istio's override_host); an ORIGINAL_DST pool answers 503 to a list.
    fallback_list: bool = False
    # An InferenceObjective's name -> the tier its requests are admitted in, or None
    # (extproc.backends.inference_pool.objective_tiers, kept by extproc.service.kube_pool).
    objective_tier: Callable[[str], str | None] | None = None


class PickerStream(StreamProcessor):
    """``StreamProcessor``'s plumbing (the refusal answer, rate headers, settle) with the
    picker's phases: each returns the list of answers to send, in order."""

    def __init__(self, rt: Runtime, peer: PeerStream, options: PickerOptions | None = None) -> None:
        super().__init__(rt, peer)
        self.options = options or PickerOptions()
        self.duplex_request = True  # until protocol_config says otherwise
        self.duplex_response = True
        self.response_body_seen = True  # False: the gateway sends no response body (mode NONE)
        self.held_path: dict[str, str] | None = None  # the request-headers answer's, held (duplex)
        self.chunks: list[bytes] = []
        self.held_bytes = 0
        self.passing = False  # answered without admission (pass-through path): echo what comes
        self.response_headers_out: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.responding = False  # response headers seen: from here on, body chunks are echoes

    # -- dispatch ------------------------------------------------------------------
    def answer(self, phase: str, request: pb.ProcessingRequest) -> list[Answer]:
        """The answers to a message of any phase but a request body or trailers."""
        if phase == "response_body":
            b = request.response_body
            return self.response_chunk(b.body, b.end_of_stream)
        try:
            if phase == "request_headers":
                return self._request_headers(request)
            if phase == "response_headers":
                return [self._response_headers(request)]
            if phase == "response_trailers":
                return [self._response_trailers()]
            return []
        except Refusal as rej:
            return self._refusal(rej)

    async def request_body(self, request: pb.ProcessingRequest) -> AsyncIterator[Answer]:
        """A request body chunk: held until the last, then admitted and answered."""
        b = request.request_body
        if self.finished:
            return
        if self.passing:
            for a in self._pass_body("request_body", b):
                yield a
            return
        if self.duplex_request:
            self.chunks.append(b.body)
            self.held_bytes += len(b.body)
            cap = self.policy.gateway.max_body_bytes
            if self.held_bytes > cap:  # refused as it grows: a chunked upload is never held whole
                self.chunks = []
                for a in self._refusal(Refusal(Reason.BODY_TOO_LARGE,
                                               f"Request body is over the limit of {cap} bytes.")):
                    yield a
                return
            if not b.end_of_stream:
                return
            body = b"".join(self.chunks)
            self.chunks = []
        else:
            body = b.body
        async for a in self._admit(body, trailers=False):
            yield a

    async def request_trailers(self) -> AsyncIterator[Answer]:
        """Trailers end a duplex request body that had them: the admission happens here."""
        if self.finished:
            return
        if self.passing or not self.duplex_request or self.held_path is None:
            yield _TRAILERS["request_trailers"]
            return
        body = b"".join(self.chunks)
        self.chunks = []
        async for a in self._admit(body, trailers=True):
            yield a

    def _refusal(self, rej: Refusal) -> list[Answer]:
        got = self._refused(rej)
        return [] if got is None else [got]

    # -- request side ---------------------------------------------------------------
    def _modes(self, request: pb.ProcessingRequest) -> None:
        got = pp.body_modes(request)
        if got is None:
            return
        req_mode, resp_mode = got
        self.duplex_request = req_mode == pp.FULL_DUPLEX
        self.duplex_response = resp_mode == pp.FULL_DUPLEX
        self.response_body_seen = resp_mode != pp.NONE

    def _request_headers(self, request: pb.ProcessingRequest) -> list[Answer]:
        self._modes(request)
        self.subset = pp.subset_hint(request)
        h = request.request_headers
        headers = msg.header_map(h, _PICKER_REQUEST_HEADERS)
        tenant = self.tenant = intake.tenant_of(self.policy, headers)
        self.limits = self.policy.limits(tenant)  # the tenant's own budgets, whatever its objective
        tenant = self.tenant = self._objective(headers, tenant)
        got = intake.route(self.policy, tenant, headers, h.end_of_stream)
        if isinstance(got, intake.Models):
            self.rt.metrics.bypassed(tenant.name, "models")
            self.finished = True
            return [msg.immediate(200, got.body, {**self._rate_headers(), **self._budget_headers()}, "sluice_models")]
        if got.kind is None:  # a pass-through path: routed now, nothing admitted
            self.rt.metrics.bypassed(tenant.name, "passthrough")
            self.passing = True
            fwd = upstream.passthrough(self.rt, self.policy, tenant, got.clean_path, self._destination)
            set_headers = dict(fwd.set_headers)
            first = self.policy.backends[0]
            if pp.DESTINATION not in set_headers and not first.is_pool and (ip := resolve(first.host)) is not None:
                set_headers[pp.DESTINATION] = f"{ip}:{first.port}"  # the gateway's pool needs an address
            return [self._headers_answer(set_headers, fwd.remove_headers)]
        self.kind = got.kind
        self.settlement = Settlement(self.rt, tenant, self.limits, self.policy.tiers[tenant.tier], self.arrived_s)
        self.admission = Admission(self.rt, self.policy, tenant, self.limits, self.peer, self.settlement)
        self.admission.precheck(self.rt.clock())  # a key that cannot pay for one token: before its body
        self._read_on(headers)
        path = {":path": got.clean_path} if got.clean_path else {}
        if self.duplex_request:
            self.held_path = path  # answered with the routing once the body is in
            return []
        return [self._headers_answer(path, ())]

    def _objective(self, headers: dict[str, str], tenant: Tenant) -> Tenant:
        """A request naming a sheddable InferenceObjective is admitted in the tier it maps to,
        when that ranks below the tenant's own; its budgets stay the tenant's (``self.limits``)."""
        lookup = self.options.objective_tier
        if lookup is None:
            return tenant
        name = next((headers[k] for k in OBJECTIVE_HEADERS if k in headers), None)
        tier = lookup(name) if name else None
        tiers = self.policy.tiers
        if tier is not None and tier in tiers and tiers[tier].priority < tiers[tenant.tier].priority:
            return replace(tenant, tier=tier)
        return tenant

    def _destination(self, primary: str, second: str | None) -> dict[str, str]:
        """``upstream``'s hook: how a pick is named to the gateway (one value for the header and
        the metadata; a list only where the gateway takes one)."""
        value = pp.destination_value(primary, (second,) if second else (), self.options.fallback_list)
        return {pp.DESTINATION: value}

    async def _admit(self, body: bytes, trailers: bool) -> AsyncIterator[Answer]:
        try:
            assert self.tenant is not None and self.kind is not None
            assert self.admission is not None and self.settlement is not None
            req, backend, model = intake.check_body(self.policy, self.kind, body)
            if self.subset is not None and not self._subset_known():
                raise Refusal(Reason.NO_ENDPOINT, "No endpoint in the gateway's subset is eligible.",
                              code="service_unavailable")
            ticket = None
            async for step in self.admission.admit(req, backend, model):
                if not isinstance(step, Wait):  # a duplex stream has no message timer to push back
                    ticket = step
            assert ticket is not None
            if self.subset is not None:
                self._within_subset(ticket)
            fwd = upstream.forward(self.rt, self.policy, self.tenant, req, ticket, self._destination)
            answers = self._routed(fwd, body, ticket, trailers)
            self.settlement.forwarded()
        except Refusal as rej:
            answers = self._refusal(rej)
        for a in answers:
            yield a

    def _routed(self, fwd: upstream.Forward, body: bytes, ticket: Ticket, trailers: bool) -> list[Answer]:
        """The admitted request's answers: the endpoint named, the body sent on."""
        set_headers = {k: v for k, v in fwd.set_headers.items() if k not in _OWN_ONLY}
        if pp.DESTINATION not in set_headers:
            dest = self._backend_address(ticket)
            if dest is None:
                raise Refusal(Reason.NO_ENDPOINT, "No endpoint of the pool is ready.", code="service_unavailable")
            set_headers[pp.DESTINATION] = dest
        self.response_headers_out = {k: v for k, v in fwd.response_headers.items()
                                     if k != usage_record.HIDE_USAGE_KEY}
        new_body = fwd.body if fwd.body is not None else body
        if self.duplex_request:
            assert self.held_path is not None
            head = self._headers_answer({**self.held_path, **set_headers, "content-length": str(len(new_body))},
                                        fwd.remove_headers)
            self.held_path = None
            out: list[Answer] = [head, *pp.echo_all(pp.REQUEST_BODY_FIELD, new_body, not trailers)]
            if trailers:
                out.append(_TRAILERS["request_trailers"])
            return out
        answer = msg.body_response("request_body", fwd.body, set_headers, _gateway_removals(fwd.remove_headers),
                                   clear_route_cache=True)
        _set_lb(answer, set_headers[pp.DESTINATION])
        return [answer]

    def _backend_address(self, ticket: Ticket) -> str | None:
        """A backend of one address is named by it (the gateway's ORIGINAL_DST needs an ip:port)."""
        if ticket.backend.is_pool:
            return None
        ip = resolve(ticket.backend.host)
        return None if ip is None else f"{ip}:{ticket.backend.port}"

    def _subset_known(self) -> bool:
        assert self.subset is not None
        known = {st.destination for be in self.rt.backends.values() if be.endpoints is not None
                 for st in be.endpoints.by_key.values() if st.ip is not None}
        return bool(self.subset & known)

    def _within_subset(self, ticket: Ticket) -> None:
        """The gateway's subset hint binds the pick: a placement outside it moves to the best
        endpoint inside (the score's choice; slot and KV follow, as a re-pick's do); when
        nothing in the subset has room, 503."""
        assert self.subset is not None
        eps, hold = ticket.backend_state.endpoints, ticket.hold
        if eps is None or hold is None or hold.endpoint is None:
            raise Refusal(Reason.NO_ENDPOINT, "No endpoint in the gateway's subset is eligible.",
                          code="service_unavailable")
        placed = eps.by_key.get(hold.endpoint)
        if placed is not None and placed.ip is not None and placed.destination in self.subset:
            return
        inside = [c for c in eps.candidates(self.rt.clock(), hold.kv) if c.key != hold.endpoint
                  and eps.by_key[c.key].ip is not None and eps.by_key[c.key].destination in self.subset]
        got = pick(inside, hold.kv)
        if got is None or not eps.move(hold.endpoint, got.key, hold.kv, repick=False,
                                       tier=hold.grant.tier):
            raise Refusal(Reason.NO_ENDPOINT, "No endpoint in the gateway's subset has room.",
                          code="service_unavailable")
        ticket.moved(got.key)

    def _headers_answer(self, set_headers: dict[str, str], remove: tuple[str, ...]) -> pb.ProcessingResponse:
        """The request-headers answer; with an endpoint named, the metadata and a new route."""
        dest = set_headers.get(pp.DESTINATION)
        removals = _gateway_removals(remove) + (() if dest is not None else (pp.DESTINATION,))
        answer = msg.headers_response("request_headers", set_headers, removals)
        if dest is not None:
            answer.request_headers.response.clear_route_cache = True
            _set_lb(answer, dest)
        return answer

    def _pass_body(self, phase: str, b: pb.HttpBody) -> list[Answer]:
        if self.duplex_request if phase == "request_body" else self.duplex_response:
            field = pp.REQUEST_BODY_FIELD if phase == "request_body" else pp.RESPONSE_BODY_FIELD
            return [pp.echo(field, b.body, b.end_of_stream)]
        return [_BODY_CONTINUE[phase]]

    # -- response side --------------------------------------------------------------
    def _response_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self.responding = True
        s = self.settlement
        if self.passing or s is None or not s.admitted:
            return _RESPONSE_HEADERS_CONTINUE
        h = request.response_headers
        headers = msg.header_map(h, RESPONSE_HEADERS)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        now = self.rt.clock()
        s.responded(status, now, "text/event-stream" in headers.get("content-type", ""))
        served = pp.served(request)
        if served is not None and s.ticket is not None:
            served_elsewhere(s.ticket, served, self.rt.metrics, now)
        if not s.settled and self.response_body_seen:
            s.watch(self._tracker(s, status))
        if h.end_of_stream:
            s.settle(Ending.END_OF_STREAM)
        if not self.response_headers_out:
            return _RESPONSE_HEADERS_CONTINUE
        return msg.headers_response("response_headers", self.response_headers_out)

    @staticmethod
    def _tracker(s: Settlement, status: int) -> SSETracker | JSONTracker:
        req = s.req
        assert req is not None
        if req.stream and status < 400:
            if req.kind == "responses":  # its usage is in its final event, read with the rest
                return SSETracker(drop_usage_chunk=False, responses=True)
            return UsageOnlyTracker(drop_usage_chunk=not req.usage_requested)
        return JSONTracker(responses=req.kind == "responses")

    def response_chunk(self, body: bytes, end_of_stream: bool) -> list[Answer]:
        """A response body chunk's answer: the one message per SSE event, so the serving path
        may call this straight from the bytes it read (``picker_protocol.response_chunk``)."""
        try:
            return [self._response_body(body, end_of_stream)]
        except Refusal as rej:
            return self._refusal(rej)

    def _response_body(self, body: bytes, end_of_stream: bool) -> Answer:
        s = self.settlement
        chunk = body
        if s is not None and s.tracker is not None and not s.settled:
            replaced = s.tracker.feed(chunk, end_of_stream)
            if replaced is not None:
                chunk = replaced
        if end_of_stream:
            self.settle(Ending.END_OF_STREAM)
        if self.duplex_response:
            return pp.echo(pp.RESPONSE_BODY_FIELD, chunk, end_of_stream)
        if chunk is body:
            return _BODY_CONTINUE["response_body"]
        return msg.body_response("response_body", chunk)

    def _response_trailers(self) -> pb.ProcessingResponse:
        s = self.settlement
        if s is not None and s.tracker is not None and not s.settled:
            s.tracker.feed(b"", True)  # a body read here ends with the trailers, not a last chunk
        self.settle(Ending.END_OF_STREAM)
        return _TRAILERS["response_trailers"]


def _gateway_removals(remove: tuple[str, ...]) -> tuple[str, ...]:
    """What Sluice removes from a request, less the x-envoy-* names a gateway's default
    mutation rules refuse (Sluice's own Envoy allows exactly those; a gateway strips client
    copies at its edge)."""
    return tuple(r for r in remove if not r.startswith("x-envoy-"))


def _set_lb(answer: pb.ProcessingResponse, dest: str) -> None:
    fields = answer.dynamic_metadata.fields[pp.NAMESPACE].struct_value.fields
    fields[pp.DESTINATION].string_value = dest
