"""One HTTP stream's life through Sluice: a small state machine, one method per phase.

headers -> body (verdict, pre-charge, slot) -> response headers -> streamed body -> settle.
Every way a stream can end (end of stream, upstream error, client disconnect, Envoy
resetting the ext_proc stream, a message timeout, a rejection after admission)
reaches ``settle()``, which gives back what the request held exactly once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import latency
from extproc import messages as msg
from extproc.admission import Admission, Reject, Ticket
from extproc.errors import REASONS, error_body, format_duration, retry_after_headers
from extproc.openai_body import BadRequest, ParsedRequest, parse_request, path_kind, upstream_body
from extproc.peer import PeerStream
from extproc.policy.breaker import outcome_for_status
from extproc.policy.gate import RateView
from extproc.policy.schema import Limits, Model, Tenant
from extproc.response import JSONTracker, SSETracker
from extproc.runtime import Runtime

log = logging.getLogger("sluice.stream")

KEY_HEADERS = ("authorization", "x-api-key")
REQUEST_HEADERS = frozenset({":path", ":method", "content-length", *KEY_HEADERS})
RESPONSE_HEADERS = frozenset({":status", "content-type"})


def api_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def ratelimit_headers(tokens: RateView, requests: RateView) -> dict[str, str]:
    return {
        "x-ratelimit-limit-tokens": str(tokens.limit),
        "x-ratelimit-remaining-tokens": str(tokens.remaining),
        "x-ratelimit-reset-tokens": format_duration(tokens.reset_s),
        "x-ratelimit-limit-requests": str(requests.limit),
        "x-ratelimit-remaining-requests": str(requests.remaining),
        "x-ratelimit-reset-requests": format_duration(requests.reset_s),
    }


class StreamProcessor:
    def __init__(self, rt: Runtime, peer: PeerStream) -> None:
        self.rt = rt
        self.peer = peer
        self.policy = rt.policy  # pinned for the stream's lifetime
        self.tenant: Tenant | None = None
        self.limits: Limits | None = None
        self.kind: str | None = None
        self.req: ParsedRequest | None = None
        self.ticket: Ticket | None = None
        self.prompt_tokens = 0
        self.reserved = 0
        self.admitted = False  # tokens are pre-charged and must be settled
        self.settled = False
        self.finished = False  # an immediate response ended the exchange
        self.status = 0
        self.first_byte_s: float | None = None
        self.arrived_s = rt.clock()  # the stream starts with the request's headers
        self.forwarded = False  # the request went on to the backend
        self.tracker: SSETracker | JSONTracker | None = None

    # -- dispatch -----------------------------------------------------------
    async def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        phase = request.WhichOneof("request") or "unknown"
        timer = self.rt.metrics.child(self.rt.metrics.phase_seconds, phase)
        t0 = time.perf_counter()
        try:
            async for response in self._dispatch(phase, request):
                # Timed up to the answer: not the time gRPC takes to send it.
                timer.observe(time.perf_counter() - t0)
                yield response
                t0 = time.perf_counter()
        except Reject as rej:
            if rej.reason == "client_gone":
                self.settle("rejected")  # never reached the backend: nothing to bill
            else:
                response = self.reject(rej)
                timer.observe(time.perf_counter() - t0)
                yield response
            self.finished = True

    async def _dispatch(self, phase: str, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        if phase == "request_headers":
            yield self.on_request_headers(request.request_headers)
        elif phase == "request_body":
            async for response in self.on_request_body(request.request_body):
                yield response
        elif phase == "response_headers":
            yield self.on_response_headers(request.response_headers)
        elif phase == "response_body":
            if self.tracker is None and self.admitted and not self.settled:
                self._start_response(request)
            yield self.on_response_body(request.response_body)
        elif phase.endswith("trailers"):
            yield pb.ProcessingResponse(**{phase: pb.TrailersResponse()})

    def reject(self, rej: Reject) -> pb.ProcessingResponse:
        # Anything held by a request refused after its pre-charge goes back first.
        self.settle("rejected")
        status, etype = REASONS.get(rej.reason, (400, "invalid_request_error"))
        tenant = self.tenant.name if self.tenant else "-"
        m = self.rt.metrics
        m.child(m.requests, tenant, rej.reason).inc()
        m.child(m.rejections, rej.reason, str(status)).inc()
        if self.tenant is not None:
            self.rt.count_rejection(self.tenant.name, rej.reason)
        headers = {"x-sluice-reason": rej.reason, **rej.headers}
        return msg.immediate(status, error_body(rej.message, etype, rej.code, rej.param), headers,
                             f"sluice_{rej.reason}")

    # -- request side -------------------------------------------------------
    def on_request_headers(self, h: pb.HttpHeaders) -> pb.ProcessingResponse:
        headers = msg.header_map(h, REQUEST_HEADERS)
        gw = self.policy.gateway
        key = api_key(headers)
        tenant = self.policy.tenant_for_key(key) if key else None
        if tenant is None:
            raise Reject("unknown_key", "Missing API key." if key is None else "Incorrect API key provided.",
                         code="invalid_api_key")
        self.tenant = tenant
        self.limits = self.policy.limits(tenant)
        path = headers.get(":path", "/")
        self.kind = path_kind(path)
        if self.kind is None:
            if gw.unknown_paths == "reject":
                raise Reject("unknown_path", f"Unknown path {path.split('?', 1)[0]!r}.", code="not_found")
            self.rt.metrics.child(self.rt.metrics.requests, tenant.name, "passthrough").inc()
            return msg.headers_response("request_headers", self._identity_headers(),
                                        KEY_HEADERS if gw.strip_api_key else (), mode_override=msg.SKIP_REST)
        if headers.get(":method", "POST") != "POST":
            raise Reject("bad_request", f"{path} takes POST.", code="method_not_allowed")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > gw.max_body_bytes:
            raise Reject("body_too_large", f"Request body is {int(length)} bytes; the limit is {gw.max_body_bytes}.")
        if h.end_of_stream:
            raise Reject("bad_request", "Request body is required.", code="missing_body")
        return msg.headers_response("request_headers")

    def _identity_headers(self) -> dict[str, str]:
        assert self.tenant is not None
        return {"x-sluice-tenant": self.tenant.name, "x-sluice-tier": self.tenant.tier}

    async def on_request_body(self, b: pb.HttpBody) -> AsyncIterator[pb.ProcessingResponse]:
        assert self.tenant is not None and self.limits is not None and self.kind is not None
        gw = self.policy.gateway
        raw = b.body
        # Chunked uploads carry no content-length: the buffered body is the last check.
        if len(raw) > gw.max_body_bytes:
            raise Reject("body_too_large", f"Request body is {len(raw)} bytes; the limit is {gw.max_body_bytes}.")
        try:
            req = parse_request(self.kind, raw, gw.image_token_estimate)
        except BadRequest as exc:
            raise Reject("bad_request", exc.message, code=exc.code, param=exc.param) from None
        found = self.policy.by_model.get(req.model)
        if found is None:
            raise Reject("unknown_model", f"The model {req.model!r} does not exist.", code="model_not_found",
                         param="model")
        backend, model = found
        self.req = req
        prompt = req.fixed_tokens + await self.rt.count_tokens(model.encoding, req.texts)
        self.prompt_tokens = prompt
        completion = self._completion_budget(req, model, prompt)

        adm = Admission(self.rt, self.policy, self.tenant, self.limits, self.peer)
        now = self.rt.clock()
        ticket = adm.route(backend, model, completion, now)
        self.ticket = ticket
        reserve = latency.completion_tokens(self.rt, ticket, self.tenant.name, self.tenant.tier)
        cost = prompt + req.n * reserve.tpm_completion
        verdict = adm.charge(ticket, cost, now)
        if not verdict.admitted:
            assert verdict.reason is not None
            extra = ratelimit_headers(verdict.tokens, verdict.requests)
            if math.isfinite(verdict.retry_after_s):
                extra.update(retry_after_headers(verdict.retry_after_s))
            raise Reject(verdict.reason, verdict.message, code="rate_limit_exceeded", headers=extra)
        self.admitted, self.reserved = True, cost
        ticket.verdict = verdict
        for hint in adm.acquire_slot(ticket, cost, now, kv_tokens=prompt + req.n * reserve.kv_completion):
            yield hint
            await adm.wait_in_queue(ticket, now)
        ticket.admitted_at = self.rt.clock()
        self._count_admission(ticket, cost)

        new_body = upstream_body(req, ticket.completion, ticket.model.name)
        set_headers = {**self._identity_headers(), "x-sluice-backend": ticket.backend.name}
        if new_body is not None:
            set_headers["content-length"] = str(len(new_body))
        remove = KEY_HEADERS if gw.strip_api_key else ()
        # Response headers decided now travel as dynamic metadata (see envoyconfig).
        out_headers = ratelimit_headers(verdict.tokens, verdict.requests)
        if ticket.degraded:
            out_headers["x-sluice-degraded"] = ",".join(ticket.degraded)
        self.forwarded = True
        yield msg.body_response("request_body", new_body, set_headers, remove, clear_route_cache=True,
                                metadata={msg.METADATA_NAMESPACE: out_headers})

    def _count_admission(self, ticket: Ticket, cost: int) -> None:
        assert self.tenant is not None and ticket.verdict is not None
        m = self.rt.metrics
        name = self.tenant.name
        m.child(m.requests, name, "admitted").inc()
        m.child(m.tokens_precharged, name).inc(cost)
        m.in_flight.inc()
        m.child(m.bucket_tokens, name).set(ticket.verdict.tokens.remaining)
        for kind in ticket.degraded:
            m.child(m.degraded, self.tenant.tier, kind).inc()
            self.rt.count_degradation(self.tenant.name, kind)
        self.rt.track(self.tenant.name, +1)

    def _completion_budget(self, req: ParsedRequest, model: Model, prompt: int) -> int:
        """What to reserve (and enforce upstream) per generated completion."""
        if req.n == 0:
            return 0
        window = model.context_window
        if req.max_tokens is not None:
            if prompt + req.max_tokens > window:
                raise Reject("context_length",
                             f"This model's maximum context length is {window} tokens. However, you requested "
                             f"{prompt + req.max_tokens} tokens ({prompt} in the messages, {req.max_tokens} in "
                             "the completion). Please reduce the length of the messages or completion.",
                             code="context_length_exceeded", param="messages")
            return req.max_tokens
        if prompt >= window:
            raise Reject("context_length",
                         f"This model's maximum context length is {window} tokens. However, your messages "
                         f"resulted in {prompt} tokens. Please reduce the length of the messages.",
                         code="context_length_exceeded", param="messages")
        default = model.default_max_tokens or self.policy.gateway.default_max_tokens
        # The client asked for no particular length: reserve what fits, never reject for it.
        return min(default, window - prompt)

    # -- response side ------------------------------------------------------
    def _start_response(self, request: pb.ProcessingRequest) -> None:
        """First response-body message with response headers skipped: status from attributes."""
        code = msg.attribute(request, "response.code")
        self.status = int(code) if isinstance(code, (int, float)) else 200
        self.first_byte_s = self.rt.clock()
        assert self.req is not None
        if self.req.stream and self.status < 400:
            self.tracker = SSETracker(drop_usage_chunk=not self.req.usage_requested)
        else:
            self.tracker = JSONTracker()

    def on_response_headers(self, h: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Used only when Envoy is configured to send response headers."""
        headers = msg.header_map(h, RESPONSE_HEADERS)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.first_byte_s = self.rt.clock()
        set_headers: dict[str, str] = {}
        if self.tenant is not None and self.limits is not None:
            tv, rv = self.rt.state.view(self.tenant.name, self.limits, self.rt.clock())
            set_headers.update(ratelimit_headers(tv, rv))
        if self.ticket is not None and self.ticket.degraded:
            set_headers["x-sluice-degraded"] = ",".join(self.ticket.degraded)
        if self.admitted:
            ctype = headers.get("content-type", "")
            if "text/event-stream" in ctype:
                assert self.req is not None
                self.tracker = SSETracker(drop_usage_chunk=self.req.stream and not self.req.usage_requested)
            else:
                self.tracker = JSONTracker()
            if h.end_of_stream:
                self.settle("end_of_stream")
        return msg.headers_response("response_headers", set_headers)

    def on_response_body(self, b: pb.HttpBody) -> pb.ProcessingResponse:
        replacement = None
        if self.tracker is not None and not self.settled:
            replacement = self.tracker.feed(b.body, b.end_of_stream)
        if b.end_of_stream:
            self.settle("end_of_stream")
        if replacement is None:
            return msg.continue_response_body()
        return msg.body_response("response_body", replacement)

    # -- the one exit -------------------------------------------------------
    def settle(self, how: str) -> None:
        """Release what the request holds; idempotent, called on every exit path."""
        if self.settled:
            return
        self.settled = True
        now = self.rt.clock()
        if not self.admitted:
            # Refused before its pre-charge, but a half-open breaker may have let it in
            # as the probe: that place must be given back, or recovery stalls.
            if self.ticket is not None:
                self._release(self.ticket, "rejected", now)
            return
        assert self.tenant is not None
        # A request that never left Sluice (refused, or abandoned while queued) used nothing.
        actual = self._actual_usage(how) if self.forwarded and how != "rejected" else 0
        self.rt.state.settle(self.tenant.name, self.reserved, actual, now)
        t = self.ticket
        if t is not None:
            self._release(t, how, now)
            if self.forwarded and how != "rejected":
                self._observe_latency(t, how, now)
        m = self.rt.metrics
        name = self.tenant.name
        m.child(m.settles, how).inc()
        m.child(m.tokens_charged, name).inc(actual)
        if actual <= self.reserved:
            m.child(m.tokens_refunded, name).inc(self.reserved - actual)
        else:
            m.child(m.tokens_excess, name).inc(actual - self.reserved)

    def _observe_latency(self, t: Ticket, how: str, now: float) -> None:
        assert self.tenant is not None and self.req is not None
        usage = self.tracker.usage if self.tracker is not None else None
        try:
            latency.record_settle(self.rt, t, self.tenant.name, self.policy.tiers[self.tenant.tier], how=how,
                                  status=self.status, arrived=self.arrived_s, first_byte=self.first_byte_s,
                                  now=now, usage=usage, n=self.req.n)
        except Exception:  # observing must never keep the rest of settle from running
            log.exception("latency observation failed")

    def _release(self, t: Ticket, how: str, now: float) -> None:
        assert self.tenant is not None
        if t.admitted_at:
            self.rt.metrics.in_flight.dec()
            self.rt.track(self.tenant.name, -1)
        if how == "end_of_stream" and self.status:
            outcome = outcome_for_status(self.status)
        elif how == "error":
            outcome = "failure"
        else:
            # A client that leaves says nothing about the backend's health.
            outcome = "cancelled"
        latency = self.first_byte_s - t.admitted_at if self.first_byte_s and t.admitted_at else None
        if t.breaker_verdict is not None and t.breaker_verdict.allowed:
            t.runtime.breaker.record(outcome, latency, now)
        route_breaker = t.runtime.route_breakers.get(t.model.name)
        if route_breaker is not None and t.route_verdict is not None and t.route_verdict.allowed:
            route_breaker.record(outcome, latency, now)
        if t.hold is not None:
            hold, t.hold = t.hold, None
            t.runtime.release(hold, now)

    def _actual_usage(self, how: str) -> int:
        tr = self.tracker
        if tr is not None and tr.usage is not None:
            return tr.usage.total
        if how == "end_of_stream" and self.status >= 400:
            # The backend refused or failed before generating: nothing to bill.
            return 0
        if tr is None:
            # Never got response headers (upstream reset, disconnect while waiting):
            # the backend may have done the prefill, so the prompt counts.
            return self.prompt_tokens if how != "end_of_stream" else 0
        model = self.ticket.model if self.ticket is not None else None
        assert model is not None
        return self.prompt_tokens + self.rt.count_tokens_now(model.encoding, tr.texts)
