"""One module per page type; the routing table is this list."""

from __future__ import annotations

from console.views import (
    api,
    audit,
    auth,
    breakers,
    endpoint_breakers,
    export,
    keys,
    overview,
    tenants,
    tiers,
    usage,
    users,
)

BLUEPRINTS = [auth.bp, overview.bp, tenants.bp, keys.bp, tiers.bp, breakers.bp,
              endpoint_breakers.bp, audit.bp, users.bp, export.bp, usage.bp, api.bp]
