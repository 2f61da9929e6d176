"""What Envoy does to a request before any filter asks Sluice: strip the headers a client
must not set, answer a request without a key of the right shape, and hold each key and
(optionally) each client address to a rate (``extproc.policy.edge`` resolves the numbers
from the policy).

- ``strip_filter``: the first HTTP filter. Removes every client-sent ``x-sluice-*`` and the
  headers Sluice or a gateway reads to route or trust a request (``CLIENT_INTERNAL``), on
  every path: Sluice's own mutations come later and set what it means. Under a gateway
  that routes on ``x-gateway-destination-endpoint`` a client's value would otherwise pick
  the upstream host.
- ``key_guard_route``: the first route. A request whose ``Authorization`` (``Bearer
  <key>``) and ``x-api-key`` both miss the policy's ``key_pattern`` (missing, malformed,
  or two headers, which Envoy joins with a comma) gets 401 ``unknown_key`` from Envoy,
  with no ext_proc round trip.
- ``ratelimit_filters``: Envoy's local rate limit, before ext_proc, one token bucket per
  key value and per client address (wildcard descriptors, the most recent
  ``MAX_DYNAMIC`` of each kept); over it, 429 ``edge_rate_limited`` (``extproc.envoy.replies``).

Measured by ``python -m bench.floods`` (docs/floods.md).
"""

from __future__ import annotations

import datetime

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as Mutation
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRemoveOnMatch
from envoy_data_plane.envoy.config.core.v3 import (
    DataSource,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    RuntimeFractionalPercent,
)
from envoy_data_plane.envoy.config.route.v3 import (
    DirectResponseAction,
    FilterConfig,
    HeaderMatcher,
    RateLimit,
    RateLimitAction,
    RateLimitActionRemoteAddress,
    RateLimitActionRequestHeaders,
    Route,
    RouteMatch,
)
from envoy_data_plane.envoy.extensions.common.ratelimit.v3 import (
    LocalRateLimitDescriptor,
    RateLimitDescriptorEntry,
)
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
    HeaderMutation,
    Mutations,
)
from envoy_data_plane.envoy.extensions.filters.http.local_ratelimit.v3 import LocalRateLimit
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher, StringMatcher
from envoy_data_plane.envoy.type.v3 import (
    FractionalPercent,
    FractionalPercentDenominatorType,
    TokenBucket,
)
from envoy_data_plane.google.protobuf import Any

from extproc.envoy.headers import BACKEND_HEADER
from extproc.openai_api.errors import error_body
from extproc.policy.edge import EdgeLimits

__all__ = [
    "CLIENT_INTERNAL",
    "KEY_GUARD_ROUTE",
    "KEY_LIMIT_FILTER",
    "RATELIMIT_FILTERS",
    "SOURCE_LIMIT_FILTER",
    "STRIP_FILTER",
    "key_guard_route",
    "ratelimit_filters",
    "strip_filter",
]

STRIP_FILTER = "envoy.filters.http.header_mutation"
KEY_LIMIT_FILTER = "sluice.edge.key_ratelimit"  # envoy.filters.http.local_ratelimit, per key value
SOURCE_LIMIT_FILTER = "sluice.edge.source_ratelimit"  # the same, per client address
RATELIMIT_FILTERS = (KEY_LIMIT_FILTER, SOURCE_LIMIT_FILTER)
KEY_GUARD_ROUTE = "sluice_key_guard"
SLUICE_PREFIX = "x-sluice-"
# Read by Sluice, a gateway or a mesh to route or to trust a request; a client's copy is a lie.
CLIENT_INTERNAL = (
    "x-real-ip",
    "forwarded",
    "x-gateway-destination-endpoint",
    "x-gateway-destination-endpoint-subset",
    "x-envoy-peer-metadata",
    "x-envoy-peer-metadata-id",
)
MAX_DYNAMIC = 10_000  # buckets kept per wildcard descriptor (least recently used dropped)
_SECOND = datetime.timedelta(seconds=1)


def strip_filter() -> HttpFilter:
    removals = [
        Mutation(
            remove_on_match=HeaderMutationRemoveOnMatch(
                key_matcher=StringMatcher(prefix=SLUICE_PREFIX)
            )
        )
    ]
    removals += [Mutation(remove=name) for name in CLIENT_INTERNAL]
    return HttpFilter(
        name=STRIP_FILTER,
        typed_config=Any.pack(HeaderMutation(mutations=Mutations(request_mutations=removals))),
    )


def _lacks(header: str, regex: str) -> HeaderMatcher:
    """Matches when ``header`` is absent or its (joined) value is not all of ``regex``."""
    return HeaderMatcher(
        name=header,
        string_match=StringMatcher(safe_regex=RegexMatcher(regex=regex)),
        invert_match=True,
        treat_missing_header_as_empty=True,
    )


def key_guard_route(edge: EdgeLimits, disabled_filters: list[str]) -> Route:
    body = error_body(
        "Missing or malformed API key: send 'Authorization: Bearer <key>' (or one 'x-api-key').",
        "invalid_request_error",
        "invalid_api_key",
    ).decode()
    return Route(
        name=KEY_GUARD_ROUTE,
        match=RouteMatch(
            prefix="/",
            headers=[
                _lacks("authorization", f"[Bb]earer +(?:{edge.key_pattern})"),
                _lacks("x-api-key", f"(?:{edge.key_pattern})"),
                # Not once ext_proc has routed the request: Sluice removes the key it read
                # (strip_api_key) in the same answer that re-matches the route.
                HeaderMatcher(name=BACKEND_HEADER, present_match=True, invert_match=True),
            ],
        ),
        direct_response=DirectResponseAction(status=401, body=DataSource(inline_string=body)),
        response_headers_to_add=[
            HeaderValueOption(
                header=HeaderValue(key=k, value=v),
                append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in (("content-type", "application/json"), ("x-sluice-reason", "unknown_key"))
        ],
        typed_per_filter_config={
            name: Any.pack(FilterConfig(disabled=True)) for name in disabled_filters
        },
    )


def _bucket(per_s: int, burst: int) -> TokenBucket:
    return TokenBucket(max_tokens=burst, tokens_per_fill=per_s, fill_interval=_SECOND)


def _always() -> RuntimeFractionalPercent:
    return RuntimeFractionalPercent(
        default_value=FractionalPercent(
            numerator=100, denominator=FractionalPercentDenominatorType.HUNDRED
        ),
        runtime_key="sluice.edge_ratelimit",
    )


def _limiter(
    name: str, limits: list[RateLimit], descriptors: list[LocalRateLimitDescriptor]
) -> HttpFilter:
    config = LocalRateLimit(
        stat_prefix=name.rsplit(".", 1)[-1],
        # Required beside the descriptors; never the one that binds.
        token_bucket=_bucket(1 << 30, 1 << 30),
        always_consume_default_token_bucket=False,
        filter_enabled=_always(),
        filter_enforced=_always(),
        rate_limits=limits,
        descriptors=descriptors,
        max_dynamic_descriptors=MAX_DYNAMIC,
    )
    return HttpFilter(name=name, typed_config=Any.pack(config))


def ratelimit_filters(edge: EdgeLimits) -> list[HttpFilter]:
    """Per key value and per client address, as the policy says (none, one or both).

    One filter each: a local rate limit consults only the first of its descriptors a
    request matches, so a key's bucket and its address's cannot share one."""
    out = []
    if edge.key_per_s:
        headers = ("authorization", "x-api-key")
        out.append(
            _limiter(
                KEY_LIMIT_FILTER,
                [
                    RateLimit(
                        actions=[
                            RateLimitAction(
                                request_headers=RateLimitActionRequestHeaders(
                                    header_name=h, descriptor_key=h, skip_if_absent=True
                                )
                            )
                        ]
                    )
                    for h in headers
                ],
                [
                    LocalRateLimitDescriptor(
                        entries=[RateLimitDescriptorEntry(key=h)],
                        token_bucket=_bucket(edge.key_per_s, edge.key_burst),
                    )
                    for h in headers
                ],
            )
        )
    if edge.source_per_s:
        out.append(
            _limiter(
                SOURCE_LIMIT_FILTER,
                [
                    RateLimit(
                        actions=[RateLimitAction(remote_address=RateLimitActionRemoteAddress())]
                    )
                ],
                [
                    LocalRateLimitDescriptor(
                        entries=[RateLimitDescriptorEntry(key="remote_address")],
                        token_bucket=_bucket(edge.source_per_s, edge.source_burst),
                    )
                ],
            )
        )
    return out
