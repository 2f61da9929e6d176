"""What goes upstream for a request Sluice lets through: the body, the headers, and the
response headers decided now.

Mode-neutral: the adapter encodes a ``Forward`` as ext_proc mutations. Where a pool
endpoint was picked, ``destination`` says how the data path is told (Sluice's own Envoy
reads ``x-sluice-endpoint``: ``extproc.envoy.headers.endpoint_headers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.envoy import usage_record
from extproc.envoy.headers import ENDPOINT_HEADER, client_retry_removals, endpoint_headers
from extproc.openai_api.body import ParsedRequest, upstream_body
from extproc.openai_api.errors import budget_headers, ratelimit_headers
from extproc.policy.schema import Backend, Policy, Tenant
from extproc.request.intake import KEY_HEADERS
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime

__all__ = ["Destination", "Forward", "engine_priority", "forward", "passthrough"]

# Where to connect (the pick, ``ip:port``) and where to retry once (None: nowhere).
Destination = Callable[[str, str | None], dict[str, str]]


@dataclass(frozen=True, slots=True)
class Forward:
    set_headers: dict[str, str]
    remove_headers: tuple[str, ...]
    body: bytes | None = None  # the rewritten body; None: the client's, unchanged
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the response by Envoy


def identity_headers(tenant: Tenant) -> dict[str, str]:
    return {"x-sluice-tenant": tenant.name, "x-sluice-tier": tenant.tier}


def engine_priority(backend: Backend, tier_priority: int) -> int | None:
    """The upstream body's ``priority`` for a tier (None: not written). vLLM runs lower values
    first, SGLang higher ones, so the tier's priority is negated for vLLM."""
    if backend.engine_priority == "vllm":
        return -tier_priority
    if backend.engine_priority == "sglang":
        return tier_priority
    return None


def forward(rt: Runtime, policy: Policy, tenant: Tenant, req: ParsedRequest, ticket: Ticket,
            destination: Destination = endpoint_headers) -> Forward:
    """The mutation for an admitted request."""
    body = upstream_body(req, ticket.completion, ticket.model.name,
                         engine_priority(ticket.backend, policy.tiers[tenant.tier].priority))
    set_headers = {**identity_headers(tenant), "x-sluice-backend": ticket.backend.name}
    dest = _destination(rt, ticket, destination)
    if dest is not None:
        set_headers.update(dest)  # where the pool cluster connects, and retries once (extproc.request.repick)
    if body is not None:
        set_headers["content-length"] = str(len(body))
    remove = (*(KEY_HEADERS if policy.gateway.strip_api_key else ()), *client_retry_removals(set_headers))
    assert ticket.verdict is not None
    out = ratelimit_headers(ticket.verdict.tokens, ticket.verdict.requests)
    if ticket.budget is not None:
        out.update(budget_headers(ticket.budget, rt.wall()))
    if ticket.degraded:
        out["x-sluice-degraded"] = ",".join(ticket.degraded)
    if req.stream and not req.usage_requested:
        out[usage_record.HIDE_USAGE_KEY] = "1"  # Envoy's Lua filter drops the usage chunk
    return Forward(set_headers, remove, body, out)


def _destination(rt: Runtime, ticket: Ticket, destination: Destination) -> dict[str, str] | None:
    """A pool's pick and second choice; None for a single address."""
    hold, eps = ticket.hold, ticket.backend_state.endpoints
    if eps is not None and hold is not None and hold.endpoint is not None:
        rt.metrics.placed(ticket.backend.name, hold.endpoint, hold.affinity)
        second = eps.by_key.get(hold.second) if hold.second is not None else None
        return destination(eps.by_key[hold.endpoint].destination,
                           second.destination if second is not None and second.ip is not None else None)
    if eps is not None:  # shadowed slots: no placement was made; any usable endpoint
        dest = eps.any_destination(rt.clock())
        return None if dest is None else destination(dest, None)
    return None


def passthrough(rt: Runtime, policy: Policy, tenant: Tenant, clean_path: str | None,
                destination: Destination = endpoint_headers) -> Forward:
    """A path Sluice does not read goes to the first backend (the catch-all route), keys
    stripped; a pool needs an endpoint. A client's own destination header never survives."""
    eps = rt.backends[policy.backends[0].name].endpoints
    addr = eps.any_destination(rt.clock()) if eps is not None else None
    dest = destination(addr, None) if addr is not None else {}
    set_headers = {**identity_headers(tenant), **({":path": clean_path} if clean_path else {}), **dest}
    remove = (*(KEY_HEADERS if policy.gateway.strip_api_key else ()), *(() if dest else (ENDPOINT_HEADER,)),
              *client_retry_removals(dest))
    return Forward(set_headers, remove)
