"""The headers and attributes Sluice and Envoy exchange about where a request goes.

A pool request names Sluice's pick and a second choice in ``x-sluice-endpoint``
(``primary,second``, each ``ip:port``); Envoy connects to the first and, if that
connection fails, retries once on the second. With no second choice only the pick is
named, with ``x-envoy-max-retries: 0``, so Envoy does not retry on a host Sluice did
not choose. What Envoy reports back is ``UPSTREAM_ATTRIBUTE`` (``extproc.request.repick``).
"""

from __future__ import annotations

ENDPOINT_HEADER = "x-sluice-endpoint"
# The backend ext_proc routed a request to (set with the body's answer, which re-matches the
# route): never a client's (stripped on arrival), never sent upstream.
BACKEND_HEADER = "x-sluice-backend"
# The ip:port that served a pool request, as an ext_proc attribute (extproc_filter's
# POOL_RESPONSE_ATTRIBUTES): on the response headers under usage_trailers, on the first body
# chunk under streamed. Not a response header: nothing to add, remove, or leak to a client.
UPSTREAM_ATTRIBUTE = "upstream.address"
MAX_RETRIES_HEADER = "x-envoy-max-retries"

# What Envoy's router reads to retry, hedge or time out a request. A client's copy must never
# reach it: a tenant could have a failed generation replayed (run twice, billed once). Envoy
# strips client-sent x-envoy-* at the edge (bootstrap._edge_options); Sluice removes these
# too, so that holds whatever Envoy takes for internal. Envoy lets ext_proc touch exactly
# these x-envoy-* headers (ENVOY_MUTABLE, extproc_filter's mutation_rules).
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


# response_processing access_log: the key in Sluice's dynamic metadata namespace that ties
# Envoy's access-log entry to the request waiting for it, "<sink>/<n>" (extproc.envoy.access_log).
SETTLE_KEY = "settle"

# The drain for oversized uploads (extproc.service.drain), on extproc's admin port.
DRAIN_PATH = "/drain"
# Set by the drain route: the body cap Envoy's route enforced when it sent the request here.
LIMIT_HEADER = "x-sluice-body-limit"
