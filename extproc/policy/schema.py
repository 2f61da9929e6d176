"""The policy schema: plain data in, a validated, immutable ``Policy`` out.

Pure: no file access. ``policyfile`` turns YAML files into the plain document and a
map from document paths to ``file:line`` so every error points at what to fix. The
console imports this module (and only this one) to validate operator edits.

Section parsers live in ``schema_parse``, the dataclasses in ``model``; every name
stays importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.policy.model import (
    AdaptiveSettings,
    Backend,
    BreakerOverride,
    BreakerSettings,
    Degrade,
    EdgeSettings,
    Endpoint,
    Gateway,
    Limits,
    Model,
    PlacementSettings,
    Policy,
    Tenant,
    Tier,
    WatermarkSettings,
    hash_key,
)
from extproc.policy.reader import Locator, PolicyError, Problem, Reader
from extproc.policy.schema_breakers import breakers as _breakers
from extproc.policy.schema_parse import (
    ENGINES,
    KNOWN_ENCODINGS,
    MAX_QUEUE_WAIT_MS,
    SHADOW_RULES,
    _backends,
    _cross_checks,
    _gateway,
    _tenants,
    _tiers,
)

__all__ = ["AdaptiveSettings", "Backend", "BreakerOverride", "BreakerSettings", "Degrade",
           "EdgeSettings", "Endpoint", "Gateway", "Limits", "Model", "PlacementSettings", "Policy",
           "PolicyError", "Problem", "Tenant", "Tier", "WatermarkSettings", "build_policy", "hash_key",
           "ENGINES", "KNOWN_ENCODINGS", "MAX_QUEUE_WAIT_MS", "SECTIONS", "SHADOW_RULES"]

SECTIONS = ("gateway", "backends", "tiers", "tenants", "breakers")


def build_policy(doc: Mapping[str, Any], locate: Locator | None = None) -> Policy:
    """Validate a plain policy document; raise ``PolicyError`` listing every problem."""
    r = Reader(locate or (lambda path: "<policy>"))
    for key in doc:
        if key not in SECTIONS:
            r.fail((str(key),), f"unknown section (known: {', '.join(SECTIONS)})")
    gateway = _gateway(r, doc.get("gateway"))
    backends = _backends(r, doc.get("backends"))
    tiers = _tiers(r, doc.get("tiers", {}))
    tenants, by_key = _tenants(r, doc.get("tenants", []), tiers)
    breakers = _breakers(r, doc.get("breakers"), {b.name: {m.name for m in b.models} for b in backends},
                         {b.name: [e.key for e in b.endpoints] for b in backends})
    by_model = _cross_checks(r, backends, tiers, gateway)
    if r.problems:
        raise PolicyError(r.problems)
    return Policy(gateway=gateway, backends=backends, tiers=tiers, tenants=tenants,
                  by_key=by_key, by_model=by_model, breakers=breakers)
