"""One HTTP stream's life through Sluice: a small state machine, one method per phase.

headers -> body (verdict, pre-charge, slot) -> response headers -> streamed body -> settle.
Every way a stream can end (end of stream, upstream error, client disconnect, Envoy
resetting the ext_proc stream, a message timeout, a rejection after admission)
reaches ``settle()`` (``extproc.request.settle``), which gives back what the request held exactly once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import usage_record as envoy_usage
from extproc.envoy.headers import (
    ENDPOINT_HEADER,
    UPSTREAM_ATTRIBUTE,
    client_retry_removals,
    endpoint_headers,
)
from extproc.envoy.usage_record import EnvoyUsage
from extproc.openai_api import models_list
from extproc.openai_api.body import (
    BadRequest,
    ParsedRequest,
    parse_request,
    path_kind,
    upstream_body,
)
from extproc.openai_api.errors import REASONS, error_body, format_duration, retry_after_headers
from extproc.openai_api.prefix_key import prefix_keys
from extproc.openai_api.redact import redact_query
from extproc.openai_api.usage import JSONTracker, SSETracker
from extproc.policy import decision
from extproc.policy.context import completion_budget
from extproc.policy.gate import RateView, Verdict
from extproc.policy.schema import Limits, Model, Tenant
from extproc.request import observe as latency
from extproc.request.admission import Admission, Reject, Ticket
from extproc.request.repick import served_elsewhere
from extproc.request.settle import Settlement
from extproc.runtime.metrics import NO_TENANT
from extproc.runtime.runtime import Runtime
from extproc.tokens.counter import TokenizerFailed, estimate
from extproc.wire import messages as msg
from extproc.wire.peer import PeerStream

log = logging.getLogger("sluice.stream")

KEY_HEADERS = ("authorization", "x-api-key")
REQUEST_HEADERS = frozenset({":path", ":method", "content-length", *KEY_HEADERS})
RESPONSE_HEADERS = frozenset({":status", "content-type"})
PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "embeddings": "input"}
_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


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


class StreamProcessor(Settlement):
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
        self.prompt_exact = True  # False: the count stopped past the context window
        self.reserved = 0
        self.admitted = False  # tokens are pre-charged and must be settled
        self.settled = False
        self.finished = False  # an immediate response ended the exchange
        self.status = 0
        self.first_byte_s: float | None = None
        self.arrived_s = rt.clock()  # the stream starts with the request's headers
        self.forwarded = False  # the request went on to the backend
        self.tracker: SSETracker | JSONTracker | None = None
        # usage_trailers path: Envoy's usage record, and whether the body is SSE
        self.envoy_usage: EnvoyUsage | None = None
        self.sse = False

    # -- dispatch -----------------------------------------------------------
    # One synchronous call per message; only the request body (token counting off the
    # event loop, a wait in the admission queue) is awaited, once per request.
    def handle(self, phase: str, request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """Answer a message of any phase but the request body (see ``handle_body``)."""
        t0 = time.perf_counter()
        try:
            response = self._dispatch(phase, request)
        except Reject as rej:
            response = self._rejected(rej)
        if response is not None:
            self._timed(phase, t0)
        return response

    async def handle_body(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The request body's answers: a queue hint first when the request must wait."""
        t0 = time.perf_counter()
        try:
            async for response in self.on_request_body(request.request_body):
                # Timed up to the answer: not the time gRPC takes to send it.
                self._timed("request_body", t0)
                yield response
                t0 = time.perf_counter()
        except Reject as rej:
            response = self._rejected(rej)
            if response is not None:
                self._timed("request_body", t0)
                yield response

    def _timed(self, phase: str, t0: float) -> None:
        self.rt.metrics.phase(phase, time.perf_counter() - t0)

    def _rejected(self, rej: Reject) -> pb.ProcessingResponse | None:
        self.finished = True
        if rej.reason == "client_gone":
            self.settle("rejected")  # never reached the backend: nothing to bill
            return None
        return self.reject(rej)

    def _dispatch(self, phase: str, request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        if phase == "response_body":
            if self.tracker is None and self.admitted and not self.settled:
                self._start_response(request)
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

    def reject(self, rej: Reject) -> pb.ProcessingResponse:
        # Anything held by a request refused after its pre-charge goes back first.
        self.settle("rejected")
        self._charge_refused(rej.reason)
        status, etype = REASONS.get(rej.reason, (400, "invalid_request_error"))
        self.rt.metrics.rejected(rej.reason, status, self.tenant.name if self.tenant else NO_TENANT)
        headers = {"x-sluice-reason": rej.reason, **rej.headers}
        if self.tenant is not None and "x-ratelimit-limit-tokens" not in headers:
            # Once the key is known every answer says where the tenant stands.
            headers.update(self._rate_headers())
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
        served = models_list.route(path)
        if served is not None:
            return self._serve_models(served, headers.get(":method", "GET"))
        self.kind = path_kind(path)
        # A key in the query string never goes upstream (extproc/openai_api/redact.py).
        clean = redact_query(path)
        new_path = {":path": clean} if clean != path else {}
        if self.kind is None:
            if gw.unknown_paths == "reject":
                raise Reject("unknown_path", f"Unknown path {path.split('?', 1)[0]!r}.", code="not_found")
            self.rt.metrics.bypassed(tenant.name, "passthrough")
            dest = self._passthrough_destination()  # overwrites a client's; else a client's is removed
            return msg.headers_response("request_headers", {**self._identity_headers(), **new_path, **dest},
                                        (*(KEY_HEADERS if gw.strip_api_key else ()), *(() if dest else
                                                                                      (ENDPOINT_HEADER,)),
                                         *client_retry_removals(dest)),
                                        mode_override=msg.SKIP_REST)
        if headers.get(":method", "POST") != "POST":
            raise Reject("bad_request", f"{path} takes POST.", code="method_not_allowed")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > gw.max_body_bytes:
            raise Reject("body_too_large", f"Request body is {int(length)} bytes; the limit is {gw.max_body_bytes}.")
        if h.end_of_stream:
            raise Reject("bad_request", "Request body is required.", code="missing_body")
        # A key that cannot pay for one token is refused before its body is even sent here.
        self._precheck_budget(Admission(self.rt, self.policy, tenant, self.limits, self.peer))
        mode = msg.READ_RESPONSE_BODY if self.kind == "responses" and gw.response_processing != "streamed" else None
        return msg.headers_response("request_headers", new_path, mode_override=mode)

    def _serve_models(self, served: tuple[bool, str | None], method: str) -> pb.ProcessingResponse:
        """The model list (or one model) from the policy, answered here: no backend, no charge."""
        assert self.tenant is not None
        if method != "GET":
            raise Reject("bad_request", f"{models_list.PREFIX} takes GET.", code="method_not_allowed")
        listing, name = served
        if listing:
            body = models_list.list_body(self.policy, self.tenant)
        else:
            assert name is not None
            found = models_list.retrieve_body(self.policy, self.tenant, name)
            if found is None:
                raise Reject("unknown_model", f"The model {name!r} does not exist.", code="model_not_found",
                             param="model")
            body = found
        self.rt.metrics.bypassed(self.tenant.name, "models")
        self.finished = True
        return msg.immediate(200, body, self._rate_headers(), "sluice_models")

    def _rate_headers(self) -> dict[str, str]:
        assert self.tenant is not None and self.limits is not None
        tv, rv = self.rt.state.view(self.tenant.name, self.limits, self.rt.clock())
        return ratelimit_headers(tv, rv)

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
        prompt = req.fixed_tokens + await self._count_prompt(req, model)
        self.prompt_tokens = prompt
        completion = self._completion_budget(req, model, prompt)

        adm = Admission(self.rt, self.policy, self.tenant, self.limits, self.peer)
        now = self.rt.clock()
        ticket = adm.route(backend, model, completion, now)
        self.ticket = ticket
        placement = ticket.backend.placement
        if placement.prefix_affinity and ticket.backend.is_pool:
            ticket.prefix = prefix_keys(req, ticket.model.name, placement.prefix_block_bytes,
                                        placement.prefix_max_bytes)
        reserve = latency.completion_tokens(self.rt, ticket, self.tenant.name, self.tenant.tier)
        cost = prompt + req.n * reserve.tpm_completion
        verdict = adm.charge(ticket, cost, now)
        if not isinstance(verdict, Verdict):
            verdict = await verdict  # a shared store's lease was short: one round trip
        if not verdict.admitted:
            assert verdict.reason is not None
            extra = ratelimit_headers(verdict.tokens, verdict.requests)
            if math.isfinite(verdict.retry_after_s):
                extra.update(retry_after_headers(verdict.retry_after_s))
            code = "service_unavailable" if verdict.reason == "state_store_down" else "rate_limit_exceeded"
            raise Reject(verdict.reason, verdict.message, code=code, headers=extra)
        self.admitted, self.reserved = True, cost
        ticket.verdict = verdict
        for hint in adm.acquire_slot(ticket, cost, now, kv_tokens=prompt + req.n * reserve.kv_completion):
            yield hint
            await adm.wait_in_queue(ticket, now)
        ticket.admitted_at = self.rt.clock()
        self._count_admission(ticket, cost)

        new_body = upstream_body(req, ticket.completion, ticket.model.name)
        set_headers = {**self._identity_headers(), "x-sluice-backend": ticket.backend.name}
        dest = self._destination(ticket)
        if dest is not None:
            set_headers.update(dest)  # where the pool cluster connects, and retries once (extproc.request.repick)
        if new_body is not None:
            set_headers["content-length"] = str(len(new_body))
        remove = (*(KEY_HEADERS if gw.strip_api_key else ()), *client_retry_removals(set_headers))
        # Response headers decided now travel as dynamic metadata (see envoy_routes).
        out_headers = ratelimit_headers(verdict.tokens, verdict.requests)
        if ticket.degraded:
            out_headers["x-sluice-degraded"] = ",".join(ticket.degraded)
        if req.stream and not req.usage_requested:
            out_headers[envoy_usage.HIDE_USAGE_KEY] = "1"  # Envoy's Lua filter drops the usage chunk
        self.forwarded = True
        yield msg.body_response("request_body", new_body, set_headers, remove, clear_route_cache=True,
                                metadata={msg.METADATA_NAMESPACE: out_headers})

    def _destination(self, ticket: Ticket) -> dict[str, str] | None:
        """A pool's ``x-sluice-endpoint`` (the pick, and the second choice) and, without a
        second choice, ``x-envoy-max-retries: 0`` (extproc.request.repick); None for one address."""
        hold, eps = ticket.hold, ticket.runtime.endpoints
        if eps is not None and hold is not None and hold.endpoint is not None:
            self.rt.metrics.placed(ticket.backend.name, hold.endpoint, hold.affinity)
            second = eps.by_key.get(hold.second) if hold.second is not None else None
            return endpoint_headers(eps.by_key[hold.endpoint].destination,
                                    second.destination if second is not None and second.ip is not None else None)
        if eps is not None:  # shadowed slots: no placement was made; any usable endpoint
            dest = eps.any_destination(self.rt.clock())
            return None if dest is None else endpoint_headers(dest, None)
        return None

    def _passthrough_destination(self) -> dict[str, str]:
        """A pass-through path goes to the first backend (the catch-all route); a pool needs an endpoint."""
        eps = self.rt.backends[self.policy.backends[0].name].endpoints
        dest = eps.any_destination(self.rt.clock()) if eps is not None else None
        return endpoint_headers(dest, None) if dest is not None else {}

    def _precheck_budget(self, adm: Admission) -> None:
        """A tenant that cannot pay for one token is refused before its body is read or tokenized."""
        assert self.limits is not None
        v = adm.precheck(self.rt.clock())
        if v is None:
            return
        assert v.reason is not None
        extra = ratelimit_headers(v.tokens, v.requests)
        if math.isfinite(v.retry_after_s):
            extra.update(retry_after_headers(v.retry_after_s))
        message = v.message if v.reason == "rpm" else (
            f"Rate limit reached: {self.limits.tpm} tokens per minute, and this key's token budget is spent "
            "(prompts refused after counting are charged too).")
        raise Reject(v.reason, message, code="rate_limit_exceeded", headers=extra)

    async def _count_prompt(self, req: ParsedRequest, model: Model) -> int:
        """Prompt tokens, counted fairly across tenants; stops past the context window."""
        assert self.tenant is not None and self.limits is not None
        # Past the window the request is refused whatever the exact number, so the
        # count stops there: the work per request is bounded by the window.
        limit = max(0, model.context_window - req.fixed_tokens)
        if self.rt.token_pool.pending(self.tenant.name) >= self.limits.max_concurrency:
            raise Reject("slots", f"Too many concurrent requests for this key (limit {self.limits.max_concurrency}).",
                         code="rate_limit_exceeded", headers=retry_after_headers(1))
        try:
            count = await self.rt.count_prompt(model.encoding, req.texts, tenant=self.tenant.name, limit=limit)
        except TokenizerFailed as exc:
            self.prompt_tokens = min(req.fixed_tokens + estimate(req.texts), model.context_window + 1)
            raise Reject("tokenizer_failed", f"The prompt could not be tokenized: {exc}", code="tokenizer_failed",
                         param=PROMPT_PARAM.get(req.kind)) from None
        self.prompt_exact = count.complete
        return count.tokens

    def _count_admission(self, ticket: Ticket, cost: int) -> None:
        assert self.tenant is not None and ticket.verdict is not None
        self.rt.metrics.admitted(self.tenant.name, self.tenant.tier, cost, ticket.verdict.tokens.remaining,
                                 ticket.degraded)
        self.rt.track(self.tenant.name, +1)

    def _completion_budget(self, req: ParsedRequest, model: Model, prompt: int) -> int:
        """What to reserve (and enforce upstream) per generated completion (extproc.policy.context)."""
        got = completion_budget(prompt, req.max_tokens, req.n, model.context_window,
                                model.default_max_tokens or self.policy.gateway.default_max_tokens,
                                exact=self.prompt_exact, param="input" if req.kind == "responses" else "messages")
        if isinstance(got, decision.Reject):
            raise Reject.of(got)
        return got

    # -- response side ------------------------------------------------------
    def _start_response(self, request: pb.ProcessingRequest) -> None:
        """First response-body message with response headers skipped: status from attributes."""
        if self.first_byte_s is None:  # response headers skipped: the status is an attribute
            code = msg.attribute(request, "response.code")
            self.status = int(code) if isinstance(code, (int, float)) else 200
            self.first_byte_s = self.rt.clock()
            self._follow_served(request, self.first_byte_s)
        assert self.req is not None
        responses = self.req.kind == "responses"
        if self.req.stream and self.status < 400:
            self.tracker = SSETracker(drop_usage_chunk=not responses and not self.req.usage_requested,
                                      responses=responses)
        else:
            self.tracker = JSONTracker(responses=responses)

    def _follow_served(self, request: pb.ProcessingRequest, now: float) -> None:
        """The first response message names who served (``upstream.address``): after Envoy
        re-picked on a connect failure the hold follows (extproc.request.repick). A settled request
        holds nothing any more, so there is nothing to move."""
        served = msg.attribute(request, UPSTREAM_ATTRIBUTE)
        if isinstance(served, str) and self.ticket is not None:
            served_elsewhere(self.ticket, served, self.rt.metrics, now)

    def on_response_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """response_processing usage_trailers: status and first byte; the body bypasses us."""
        h = request.response_headers
        headers = msg.header_map(h, RESPONSE_HEADERS)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.first_byte_s = self.rt.clock()
        self.sse = "text/event-stream" in headers.get("content-type", "")
        self._follow_served(request, self.first_byte_s)  # before any settle below
        # Envoy synthesizes trailers only for a successful response it read the usage
        # of: an error response has nothing to bill and its end is not waited for.
        if self.admitted and (h.end_of_stream or self.status >= 400):
            self.settle("end_of_stream")
        return _HEADERS_CONTINUE

    def on_response_trailers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """The one message at a clean end of a response, carrying Envoy's usage record."""
        self.envoy_usage = envoy_usage.usage_from_metadata(request)
        if self.tracker is not None and not self.settled:
            self.tracker.feed(b"", True)  # a body read here ends with the trailers, not a last chunk
        self.settle("end_of_stream")
        return _TRAILERS_CONTINUE

    def on_response_body(self, b: pb.HttpBody) -> pb.ProcessingResponse:
        replacement = None
        if self.tracker is not None and not self.settled:
            replacement = self.tracker.feed(b.body, b.end_of_stream)
        if b.end_of_stream:
            self.settle("end_of_stream")
        if replacement is None:
            return msg.continue_response_body()
        return msg.body_response("response_body", replacement)
