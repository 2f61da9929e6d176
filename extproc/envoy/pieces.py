"""``extproc envoy-config --pieces``: what to add to an Envoy config of one's own.

Cut from the bootstrap Sluice renders for itself (``extproc.envoy.bootstrap``), so the two
cannot drift: the HTTP filters (the ext_proc filter and, under ``usage_trailers``, the Lua
filter that hides the usage chunk Sluice asked for), Sluice's ext_proc cluster, the pools'
clusters, the response headers that carry what Sluice decided (``x-ratelimit-*``) from
dynamic metadata, and the upstream filters (Envoy's usage extraction) for each backend
cluster. What stays out is what only Sluice's own listener can have: its routes by
``x-sluice-backend``, the drain route for oversized uploads, the edge settings and filters
(the header strip, the key guard, the edge rate limits: ``extproc.envoy.edge``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from extproc.envoy.access_log import CLUSTER_PREFIX
from extproc.envoy.bootstrap import ROUTER_FILTER, render_bootstrap
from extproc.envoy.clusters import DRAIN_CLUSTER
from extproc.envoy.edge import RATELIMIT_FILTERS, STRIP_FILTER
from extproc.envoy.extproc_filter import EXTPROC_CLUSTER, EXTPROC_FILTER
from extproc.envoy.options import BackendRoute, EnvoyOptions
from extproc.envoy.routes import MODE_ROUTES, ROUTE_OPENAI

GRPC_LOGGER = "envoy.access_loggers.http_grpc"

HEADER = """\
# Sluice's pieces for an Envoy config of your own (python -m extproc envoy-config --pieces).
# docs/deploying.md ("Sluice inside your own Envoy") says where each goes:
#   http_filters            into your HTTP connection manager, after your own auth filters
#                           (RBAC, JWT: a request they refuse never costs a token), before the router
#   clusters                into static_resources.clusters
#   response_headers_to_add onto the routes (or virtual hosts) that reach your model servers
#   upstream_http_filters   (usage_trailers, access_log) as http_filters of each model server
#                           cluster's envoy.extensions.upstreams.http.v3.HttpProtocolOptions
#   access_log              (access_log) into your HTTP connection manager's access_log
#   route_modes             typed_per_filter_config of the routes a request matches first:
#                           reads_body (/v1/responses, /v1/embeddings: Sluice reads the
#                           response body), other (the paths Sluice does not read:
#                           /v1/models, pass-through: headers only)
#   routes that must not be admitted (a health check): typed_per_filter_config
#     {"envoy.filters.http.ext_proc": {"@type": type.googleapis.com/envoy.config.route.v3.FilterConfig,
#      "disabled": true}}
"""


def render_pieces(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> dict[str, Any]:
    cfg = render_bootstrap(backends, opts)
    res = cfg["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # Sluice's edge (extproc.envoy.edge) is its own listener's: a gateway strips and limits
    # at its own edge, and the header strip placed after a picker would remove its pick.
    edge = {STRIP_FILTER, *RATELIMIT_FILTERS}
    filters = [f for f in hcm["http_filters"] if f["name"] not in {ROUTER_FILTER, *edge}]
    names = {b.name for b in backends}
    pools = {b.name for b in backends if b.pool}
    clusters = [c for c in res["clusters"] if c["name"] == EXTPROC_CLUSTER or c["name"] in pools
                or c["name"].startswith(CLUSTER_PREFIX)]
    upstream: list[Any] = []
    for c in res["clusters"]:
        if c["name"] in names and c["name"] != DRAIN_CLUSTER:
            for o in c.get("typed_extension_protocol_options", {}).values():
                upstream = o.get("http_filters") or upstream
    out: dict[str, Any] = {
        "http_filters": filters,
        "clusters": clusters,
        "response_headers_to_add": hcm["route_config"].get("response_headers_to_add", []),
    }
    if upstream:
        out["upstream_http_filters"] = upstream
    grpc_logs = [log for log in hcm.get("access_log", []) if log["name"] == GRPC_LOGGER]
    if grpc_logs:
        out["access_log"] = grpc_logs
    # The ext_proc mode is merged once, from the first route a request matches, and Envoy
    # ignores mode_override here (extproc.envoy.extproc_filter): the routes say it.
    modes = {r["name"]: r["typed_per_filter_config"][EXTPROC_FILTER]
             for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
             if r.get("name") in MODE_ROUTES and EXTPROC_FILTER in r.get("typed_per_filter_config", {})}
    # In someone else's Envoy the filter itself has the response side of the endpoints Sluice
    # reads, so a route without a mode of Sluice's still settles exactly. Sluice's own
    # listener keeps it on its routes instead: there the edge's own replies (429, 401) would
    # otherwise each open an ext_proc stream; a gateway's edge is its own.
    openai = modes.pop(ROUTE_OPENAI, None)
    if openai is not None:
        for f in filters:
            if f["name"] == EXTPROC_FILTER:
                f["typed_config"]["processing_mode"] = openai["overrides"]["processing_mode"]
    if modes:
        out["route_modes"] = modes
    return out


def render_pieces_yaml(backends: Sequence[BackendRoute], opts: EnvoyOptions) -> str:
    return HEADER + yaml.safe_dump(render_pieces(backends, opts), sort_keys=False)
