"""The Breakers page's rows beyond the backends': each pool endpoint's breaker and each
tenant's own breaker (``extproc.policy.tenant_breakers``), per replica, from the fresh
reports. Every replica keeps its own endpoint and tenant breakers (a shared store shares
trips, not these), so each replica's state is shown."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from console.live import Replica
from console.report_values import as_map, num, text


@dataclass
class EndpointBreakerRow:
    backend: str
    address: str
    by_replica: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # replica -> breaker

    @property
    def states(self) -> list[str]:
        return sorted({s for b in self.by_replica.values() if (s := text(b.get("state")))})


@dataclass
class TenantBreakerRow:
    scope: str  # the backend, or backend/model for a model route with its own breaker
    tenant: str
    by_replica: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # replica -> breaker


@dataclass
class TenantBreakerCounts:
    """How many tenants a backend's replicas judge, how many are failing, summed over replicas."""

    tracked: int = 0
    failing: int = 0
    breakers: int = 0


def _fresh(reps: list[Replica]) -> list[Replica]:
    return sorted((r for r in reps if not r.stale), key=lambda r: r.id)


def endpoint_breakers(names: list[str], reps: list[Replica]) -> list[EndpointBreakerRow]:
    rows: dict[tuple[str, str], EndpointBreakerRow] = {}
    for r in _fresh(reps):
        for name in names:
            b = as_map(as_map(r.status.get("backends")).get(name))
            for e in b.get("endpoints") if isinstance(b.get("endpoints"), list) else []:
                address = as_map(e).get("address")
                if isinstance(address, str):
                    row = rows.setdefault((name, address), EndpointBreakerRow(name, address))
                    row.by_replica[r.id] = as_map(as_map(e).get("breaker"))
    return sorted(rows.values(), key=lambda row: (names.index(row.backend), row.address))


def _scopes(name: str, b: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out = {name: as_map(b.get("tenant_breakers"))}
    for model, route in as_map(b.get("route_breakers")).items():
        out[f"{name}/{model}"] = as_map(as_map(route).get("tenant_breakers"))
    return out


def tenant_breakers(
    names: list[str], reps: list[Replica]
) -> tuple[list[TenantBreakerRow], dict[str, TenantBreakerCounts]]:
    """The tenants whose breaker is not closed on some replica, and per backend the counts."""
    rows: dict[tuple[str, str], TenantBreakerRow] = {}
    counts: dict[str, TenantBreakerCounts] = {}
    for r in _fresh(reps):
        for name in names:
            b = as_map(as_map(r.status.get("backends")).get(name))
            for scope, tb in _scopes(name, b).items():
                c = counts.setdefault(scope, TenantBreakerCounts())
                c.tracked += int(num(tb.get("tracked_tenants")) or 0)
                c.failing += int(num(tb.get("failing_tenants")) or 0)
                c.breakers += int(num(tb.get("breakers")) or 0)
                for tenant, br in as_map(tb.get("tripped")).items():
                    row = rows.setdefault(
                        (scope, str(tenant)), TenantBreakerRow(scope, str(tenant))
                    )
                    row.by_replica[r.id] = as_map(br)
    return sorted(rows.values(), key=lambda row: (row.scope, row.tenant)), counts
