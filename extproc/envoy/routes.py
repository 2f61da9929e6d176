"""The routes of Sluice's listener, in match order: Envoy's own 401 for a request without a
key of the right shape (extproc.envoy.edge), the drain for oversized uploads, one
route per backend picked by ``x-sluice-backend`` (a pool's with the one re-pick on a
refused connection), then the routes a request matches before Sluice has routed it, all
to the first backend: the Responses API and embeddings (Sluice reads their response
bodies), the other endpoints Sluice reads (the response side ``response_processing``
needs), and the catch-all (the paths it only authenticates); plus what
every route adds (the response headers decided on the request side) and strips
(Sluice's own headers).

The route matched first decides the ext_proc filter's mode for the whole request (Envoy
merges ``ExtProcPerRoute`` once, when the request headers reach it); the route Sluice's
answer re-selects decides only where the request goes. The filter's static mode has the
response side off, so a reply an earlier filter makes (the edge's 429) opens no stream.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.core.v3 import (
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
)
from envoy_data_plane.envoy.config.route.v3 import (
    FilterConfig,
    HeaderMatcher,
    RetryPolicy,
    RetryPolicyRetryBackOff,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ExtProcPerRoute
from envoy_data_plane.envoy.type.matcher.v3 import (
    RegexMatchAndSubstitute,
    RegexMatcher,
    StringMatcher,
)
from envoy_data_plane.envoy.type.v3 import Int64Range
from envoy_data_plane.google.protobuf import Any

from extproc.envoy.clusters import DRAIN_CLUSTER
from extproc.envoy.edge import RATELIMIT_FILTERS, key_guard_route
from extproc.envoy.extproc_filter import (
    EXTPROC_FILTER,
    headers_only,
    reads_response_body,
    response_mode,
)
from extproc.envoy.headers import BACKEND_HEADER, DRAIN_PATH, LIMIT_HEADER
from extproc.envoy.options import BackendRoute, EnvoyOptions, ms, seconds
from extproc.openai_api.body import ENDPOINTS
from extproc.wire.messages import METADATA_NAMESPACE, RESPONSE_HEADERS_FROM_METADATA

__all__ = ["BACKEND_HEADER", "LONG_IDLE", "MODE_ROUTES", "REPICK_ON", "route_config"]

# Responses whose usage Envoy's usage filter cannot read (the Responses API's rides in a
# response.completed event; an embeddings body's is not read): Sluice reads their bodies.
READS_BODY = ("responses", "embeddings")
# The routes a request matches before Sluice routes it: they set the ext_proc mode.
ROUTE_READS_BODY, ROUTE_OPENAI, ROUTE_OTHER = "reads_body", "openai", "other"
MODE_ROUTES = (ROUTE_READS_BODY, ROUTE_OPENAI, ROUTE_OTHER)
LONG_IDLE = datetime.timedelta(seconds=300)  # SSE streams may pause between tokens


def _headers_from_metadata() -> list[HeaderValueOption]:
    return [
        HeaderValueOption(
            header=HeaderValue(key=name, value=f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{name})%"),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
            keep_empty_value=False,  # absent for passthrough paths and Envoy's own replies
        )
        for name in RESPONSE_HEADERS_FROM_METADATA
    ]


# The only retry: a pool request whose connection was refused (or timed out connecting)
# goes once to Sluice's second choice (x-sluice-endpoint's next host). Never on a reset
# or a 5xx: a request that reached an engine may be generating already, and a replay
# would generate twice for one bill.
REPICK_ON = "connect-failure"


def _repick(opts: EnvoyOptions) -> RetryPolicy:
    backoff = ms(opts.repick_backoff_ms)
    return RetryPolicy(retry_on=REPICK_ON, num_retries=1,
                       retry_back_off=RetryPolicyRetryBackOff(base_interval=backoff, max_interval=backoff))


def _route(b: BackendRoute, match: RouteMatch, opts: EnvoyOptions, name: str = "",
           ext_proc: ExtProcPerRoute | None = None) -> Route:
    """A backend's route; a pool's re-picks once on a refused connection (who served comes to
    extproc as the ``upstream.address`` attribute, extproc.request.repick). ``ext_proc``: the
    filter's mode on the requests that match here first (``ExtProcPerRoute``)."""
    return Route(
        name=name,
        match=match,
        route=RouteAction(
            cluster=b.name,
            # Generations stream for minutes; past response_timeout_s Envoy ends one with
            # 504 (0: never), which also bounds how long a settle may wait for its access log.
            timeout=seconds(opts.response_timeout_s),
            idle_timeout=LONG_IDLE,
            retry_policy=_repick(opts) if b.pool else None,
        ),
        typed_per_filter_config={EXTPROC_FILTER: Any.pack(ext_proc)} if ext_proc is not None else {},
    )


def _endpoints_regex(paths: Sequence[str]) -> RegexMatcher:
    return RegexMatcher(regex="^(" + "|".join(re.escape(p) for p in paths) + ")$")


def _drain_route(opts: EnvoyOptions, filters: Sequence[str]) -> Route:
    """Uploads declaring a body over the cap go to the drain, past every filter but the router.

    Envoy answering them itself (or ext_proc answering at request headers) closes the
    connection with the body unread, and the RST destroys the 413 (see extproc/service/drain.py).
    Here Envoy streams the body to the drain, which discards it and answers 413 once the
    request is complete. A request ext_proc has rerouted (x-sluice-backend set, route
    re-matched after a body rewrite) never lands here. Only the endpoints Sluice reads
    are capped: pass-through paths (``unknown_paths: passthrough``) stream as before.
    """
    over_cap = HeaderMatcher(name="content-length",
                             range_match=Int64Range(start=opts.max_body_bytes + 1, end=1 << 62))
    not_rerouted = HeaderMatcher(name=BACKEND_HEADER, present_match=True, invert_match=True)
    return Route(
        name="drain_oversized_upload",
        match=RouteMatch(safe_regex=_endpoints_regex(list(ENDPOINTS)), headers=[over_cap, not_rerouted]),
        route=RouteAction(
            cluster=DRAIN_CLUSTER,
            regex_rewrite=RegexMatchAndSubstitute(pattern=RegexMatcher(regex="^/.*"), substitution=DRAIN_PATH),
            # counted from the end of the upload, which the drain itself bounds
            timeout=seconds(10),
        ),
        request_headers_to_add=[HeaderValueOption(
            header=HeaderValue(key=LIMIT_HEADER, value=str(opts.max_body_bytes)),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )],
        typed_per_filter_config={name: Any.pack(FilterConfig(disabled=True)) for name in filters},
    )


def _limited(opts: EnvoyOptions, name: str) -> bool:
    """Whether the listener has edge rate-limit filter ``name`` (a route may only name the
    filters it has)."""
    edge = opts.edge
    return bool(edge.key_per_s) if name == RATELIMIT_FILTERS[0] else bool(edge.source_per_s)


def route_config(backends: Sequence[BackendRoute], opts: EnvoyOptions,
                 filters: Sequence[str]) -> RouteConfiguration:
    """The listener's routes; ``filters``: the HTTP filters the drain route turns off (the key
    guard, answered by Envoy itself, turns off the edge rate limit too: its 401 is cheaper)."""
    limiters = [f for f in RATELIMIT_FILTERS if _limited(opts, f)]
    routes = [key_guard_route(opts.edge, [*filters, *limiters]),
              _drain_route(opts, filters)]
    routes.extend(
        _route(b, RouteMatch(prefix="/", headers=[
            HeaderMatcher(name=BACKEND_HEADER, string_match=StringMatcher(exact=b.name))]), opts)
        for b in backends
    )
    first = backends[0]
    body = [p for p, kind in ENDPOINTS.items() if kind in READS_BODY]
    read = [p for p, kind in ENDPOINTS.items() if kind not in READS_BODY]
    rp = opts.response_processing
    routes += [
        _route(first, RouteMatch(safe_regex=_endpoints_regex(body)), opts, ROUTE_READS_BODY,
               reads_response_body(rp)),
        _route(first, RouteMatch(safe_regex=_endpoints_regex(read)), opts, ROUTE_OPENAI,
               response_mode(rp)),
        _route(first, RouteMatch(prefix="/"), opts, ROUTE_OTHER, headers_only()),
    ]
    return RouteConfiguration(
        name="sluice_routes",
        virtual_hosts=[VirtualHost(name="sluice", domains=["*"], routes=routes)],
        # Clients cannot pick a backend or claim a body limit: Envoy strips client-sent
        # copies before any filter runs (every request is external, see envoyconfig._edge_options),
        # and the one ext_proc sets never goes upstream.
        internal_only_headers=[BACKEND_HEADER, LIMIT_HEADER],
        request_headers_to_remove=[BACKEND_HEADER],
        response_headers_to_add=_headers_from_metadata(),
    )
