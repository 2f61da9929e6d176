"""What a request says before admission weighs it: who sends it, to which path, with what body.

The checks that need no backend state, cheapest first, the same for every adapter
(Sluice's own Envoy, a gateway's endpoint picker): the key (401), the path (the models
list answered here, pass-through or 404 for others), the method, the declared and the
real body size (413), the body's encoding (415), the body itself (400 naming the field)
and its model (404). Each
returns what it read or raises ``Refusal``.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.envoy.options import buffer_limit_bytes
from extproc.openai_api import models_list
from extproc.openai_api.body import BadRequest, ParsedRequest, parse_request, path_kind
from extproc.openai_api.redact import redact_query
from extproc.policy.reasons import Reason
from extproc.policy.schema import Backend, Gateway, Model, Policy, Tenant
from extproc.request.refusal import Refusal

__all__ = ["KEY_HEADERS", "Models", "Route", "api_key", "check_body", "route", "tenant_of"]

KEY_HEADERS = ("authorization", "x-api-key")


def api_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def tenant_of(policy: Policy, headers: dict[str, str]) -> Tenant:
    """The key's tenant. A key header sent twice arrives joined with a comma (as HTTP reads
    repeated headers): refused, never one of the two picked."""
    key = api_key(headers)
    tenant = policy.tenant_for_key(key) if key and "," not in key else None
    if tenant is None:
        message = "Missing API key." if key is None else \
            "Send one API key, once." if "," in key else "Incorrect API key provided."
        raise Refusal(Reason.UNKNOWN_KEY, message, code="invalid_api_key")
    return tenant


@dataclass(frozen=True, slots=True)
class Models:
    """``GET /v1/models`` (or one model): answered from the policy, no backend, no charge."""

    body: bytes


@dataclass(frozen=True, slots=True)
class Route:
    """Where the request goes next: ``kind`` None is a pass-through path (no body read)."""

    kind: str | None
    clean_path: str | None  # the path without credentials in its query, where it had some


def route(policy: Policy, tenant: Tenant, headers: dict[str, str], end_of_stream: bool) -> Models | Route:
    """The request headers' verdict: the models list, a path to pass through, or an OpenAI
    endpoint whose body comes next."""
    gw = policy.gateway
    path = headers.get(":path", "/")
    method = headers.get(":method", "POST")
    served = models_list.route(path)
    if served is not None:
        return Models(_models(policy, tenant, served, method))
    kind = path_kind(path)
    clean = redact_query(path)  # a key in the query string never goes upstream
    clean_path = clean if clean != path else None
    if kind is None:
        if gw.unknown_paths == "reject":
            raise Refusal(Reason.UNKNOWN_PATH, f"Unknown path {path.split('?', 1)[0]!r}.", code="not_found")
        return Route(None, clean_path)
    if method != "POST":
        raise Refusal(Reason.BAD_REQUEST, f"{path} takes POST.", code="method_not_allowed")
    length = headers.get("content-length")
    if length is not None and length.isdigit():
        _check_size(int(length), gw)
    if end_of_stream:
        raise Refusal(Reason.BAD_REQUEST, "Request body is required.", code="missing_body")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        # Sluice reads (and bills) the body as it arrives. Forwarded with this header the
        # backend would decode a body Sluice never read, or fail on the plain JSON it read
        # (an aiohttp-based engine answers 500: one tenant opening everyone's breaker).
        raise Refusal(Reason.UNSUPPORTED_ENCODING,
                      f"Content-Encoding {encoding!r} is not supported: "
                      "send the body uncompressed.",
                      code="unsupported_media_type")
    return Route(kind, clean_path)


def body_ahead(headers: dict[str, str], gw: Gateway) -> int:
    """How much of ext_proc's messages a request Sluice goes on to read has still to send:
    its body (the content-length, which ``route`` held to the cap, or sent chunked, the most
    that is read before it is refused) and each chunk's framing."""
    length = headers.get("content-length")
    size = int(length) if length is not None and length.isdigit() else chunked_limit(gw.max_body_bytes)
    return size + size // 256 + (16 << 10)


def chunked_limit(cap: int) -> int:
    """The most of a body sent without a content-length that is read before it is refused
    for its size: past the cap Envoy's buffer fills and stops reading, so waiting for the
    end would only end in its message timeout (``StreamProcessor._take_chunk``)."""
    return (cap + buffer_limit_bytes(cap)) // 2


def _models(policy: Policy, tenant: Tenant, served: tuple[bool, str | None], method: str) -> bytes:
    if method != "GET":
        raise Refusal(Reason.BAD_REQUEST, f"{models_list.PREFIX} takes GET.", code="method_not_allowed")
    listing, name = served
    if listing:
        return models_list.list_body(policy, tenant)
    assert name is not None
    found = models_list.retrieve_body(policy, tenant, name)
    if found is None:
        raise Refusal(Reason.UNKNOWN_MODEL, f"The model {name!r} does not exist.", code="model_not_found",
                      param="model")
    return found


def _check_size(size: int, gw: Gateway) -> None:
    if size > gw.max_body_bytes:
        raise Refusal(Reason.BODY_TOO_LARGE, f"Request body is {size} bytes; the limit is {gw.max_body_bytes}.")


def check_body(policy: Policy, kind: str, raw: bytes) -> tuple[ParsedRequest, Backend, Model]:
    """The parsed body and the backend and model it names."""
    gw = policy.gateway
    _check_size(len(raw), gw)  # chunked uploads carry no content-length: this is the last check
    try:
        req = parse_request(kind, raw, gw.image_token_estimate)
    except BadRequest as exc:
        raise Refusal(Reason.BAD_REQUEST, exc.message, code=exc.code, param=exc.param) from None
    found = policy.by_model.get(req.model)
    if found is None:
        raise Refusal(Reason.UNKNOWN_MODEL, f"The model {req.model!r} does not exist.", code="model_not_found",
                      param="model")
    return req, found[0], found[1]
