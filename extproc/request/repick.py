"""A failed connection to a pool endpoint re-picks once: the hold follows the request.

Request side: Sluice names its pick and a second choice (``extproc.envoy.headers``).

Response side: Envoy sends the ``upstream.address`` attribute (``UPSTREAM_ATTRIBUTE``, the
``ip:port`` that served) with the first response message; when it names another endpoint
than the pick, the request's hold follows it there (``served_elsewhere``): the pick's slot and KV are released,
the served endpoint's taken (over its budget if need be: the request already runs there),
and the pick's breaker hears a failure. The request's own outcome is still reported once,
at settle, to the endpoint that served it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from extproc.policy.breaker_outcome import Outcome

if TYPE_CHECKING:
    from extproc.request.ticket import Ticket
    from extproc.runtime.metrics import Metrics

log = logging.getLogger("sluice.repick")

UNKNOWN = "unknown"  # the to_endpoint label of a served address that is not in the pool


def served_elsewhere(ticket: Ticket, served: str, metrics: Metrics, now: float) -> str | None:
    """Follow the request to the endpoint that served it (``served``: ``ip:port``).

    Returns the endpoint key it moved to, ``"unknown"`` for an address not in the pool
    (the hold stays), or None when the pick served it (or nothing is held on the pool)."""
    hold, eps = ticket.hold, ticket.backend_state.endpoints
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
    if to == hold.endpoint or not eps.move(hold.endpoint, to, hold.kv, tier=hold.grant.tier):
        return None
    ticket.moved(to)
    # The pick refused the connection: that counts toward ejecting it. The pool's breakers
    # hear the request's outcome once, at settle, through the endpoint that served it.
    eps.record(hold.endpoint, Outcome.FAILURE, None, now)
    if ticket.prefix and eps.affinity is not None:
        eps.affinity.record(ticket.prefix, to, now)  # the served engine holds the prefix now
    metrics.repicked(backend, hold.endpoint, to)
    log.info("pool %s: %s refused the connection; re-picked to %s (second choice %s)",
             backend, hold.endpoint, to, hold.second)
    return to
