"""A failed connection to a pool endpoint re-picks once (issue 11): the headers both ways.

Request side: Sluice names its pick and a second choice in ``x-sluice-endpoint``
(``primary,second``, each ``ip:port``); Envoy connects to the first and, if that connection
fails, retries once on the second. With no second choice it names only the pick and sends
``x-envoy-max-retries: 0``, so Envoy does not retry on a host Sluice did not choose.

Response side: Envoy sends the ``upstream.address`` attribute (``UPSTREAM_ATTRIBUTE``, the
``ip:port`` that served) with the first response message; when it names another endpoint
than the pick, the request's hold follows it there (``served_elsewhere``): the pick's slot and KV are released,
the served endpoint's taken (over its budget if need be: the request already runs there),
and the pick's breaker hears a failure. The request's own outcome is still reported once,
at settle, to the endpoint that served it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from extproc.policy.breaker import Outcome

if TYPE_CHECKING:  # envoy_extproc imports this module (Envoy config rendering): keep it light
    from extproc.admission import Ticket
    from extproc.metrics import Metrics

log = logging.getLogger("sluice.repick")

ENDPOINT_HEADER = "x-sluice-endpoint"  # as extproc.stream and extproc.envoy_clusters name it
# The ip:port that served a pool request, as an ext_proc attribute (envoy_extproc's
# POOL_RESPONSE_ATTRIBUTES): on the response headers under usage_trailers, on the first body
# chunk under streamed. Not a response header: nothing to add, remove, or leak to a client.
UPSTREAM_ATTRIBUTE = "upstream.address"
MAX_RETRIES_HEADER = "x-envoy-max-retries"
UNKNOWN = "unknown"  # the to_endpoint label of a served address that is not in the pool

# What Envoy's router reads to retry, hedge or time out a request. A client's copy must never
# reach it: a tenant could have a failed generation replayed (run twice, billed once). Envoy
# strips client-sent x-envoy-* at the edge (envoyconfig._edge_options); Sluice removes these
# too, so that holds whatever Envoy takes for internal. Envoy lets ext_proc touch exactly
# these x-envoy-* headers (ENVOY_MUTABLE, envoy_extproc's mutation_rules).
CLIENT_RETRY_HEADERS = (
    "x-envoy-retry-on", MAX_RETRIES_HEADER, "x-envoy-retry-grpc-on", "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names", "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-rq-per-try-timeout-ms", "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
)
# Every name above, by prefix (Envoy matches the whole name, and refuses a regex whose RE2
# program is over 100: the list spelt out is 150). Only Sluice's own mutations meet it.
ENVOY_MUTABLE = "x-envoy-(retr|max-retries|hedge-on|upstream-rq-).*"
# Removed from every request Sluice forwards; one Sluice sets itself is overwritten instead.
_REMOVE_ALL = CLIENT_RETRY_HEADERS
_REMOVE_BUT_MAX_RETRIES = tuple(h for h in CLIENT_RETRY_HEADERS if h != MAX_RETRIES_HEADER)


def client_retry_removals(set_headers: dict[str, str]) -> tuple[str, ...]:
    """The client retry headers to remove from a request whose mutation sets ``set_headers``."""
    return _REMOVE_BUT_MAX_RETRIES if MAX_RETRIES_HEADER in set_headers else _REMOVE_ALL


def endpoint_headers(primary: str, second: str | None) -> dict[str, str]:
    """The request headers that tell Envoy where to connect, and where to retry once."""
    if second is not None and second != primary:
        return {ENDPOINT_HEADER: f"{primary},{second}"}
    return {ENDPOINT_HEADER: primary, MAX_RETRIES_HEADER: "0"}


def served_elsewhere(ticket: Ticket, served: str, metrics: Metrics, now: float) -> str | None:
    """Follow the request to the endpoint that served it (``served``: ``ip:port``).

    Returns the endpoint key it moved to, ``"unknown"`` for an address not in the pool
    (the hold stays), or None when the pick served it (or nothing is held on the pool)."""
    hold, eps = ticket.hold, ticket.runtime.endpoints
    if hold is None or hold.endpoint is None or eps is None:
        return None
    primary = eps.by_key.get(hold.endpoint)
    if primary is not None and primary.ip is not None and primary.destination == served:
        return None
    to = eps.key_of(served)
    backend = ticket.backend.name
    if to is None:
        metrics.repicked(backend, hold.endpoint, UNKNOWN)
        log.warning("pool %s: request placed on %s was served by %s, not an endpoint of the pool; "
                    "its reservation stays on %s", backend, hold.endpoint, served, hold.endpoint)
        return UNKNOWN
    if to == hold.endpoint or not eps.move(hold.endpoint, to, hold.kv):
        return None
    ticket.hold = replace(hold, endpoint=to, second=None)
    # The pick refused the connection: that counts toward ejecting it. The pool's breakers
    # hear the request's outcome once, at settle, through the endpoint that served it.
    eps.record(hold.endpoint, Outcome.FAILURE, None, now)
    if ticket.prefix and eps.affinity is not None:
        eps.affinity.record(ticket.prefix, to, now)  # the served engine holds the prefix now
    metrics.repicked(backend, hold.endpoint, to)
    log.info("pool %s: %s refused the connection; re-picked to %s (second choice %s)",
             backend, hold.endpoint, to, hold.second)
    return to
