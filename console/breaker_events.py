"""Breaker state changes seen between two reports of one replica, kept as history: a
backend's breaker, each pool endpoint's, and each tenant's own breaker on a backend (or on
one of its model routes, ``backend/model``, as the metrics label it).

A replica reports tenant breakers only while they are not closed (``tripped``), so a
tenant that leaves the list has closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlite_utils import Database

from console.report_values import as_map, num, text
from console.store import Store


def _insert(
    db: Database,
    now: float,
    replica: str,
    backend: str,
    before: str | None,
    state: str,
    trips: float | None,
    endpoint: str | None = None,
    tenant: str | None = None,
) -> None:
    db.execute(
        "INSERT INTO breaker_events "
        "(at, replica, backend, from_state, to_state, trips, endpoint, tenant) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            now,
            replica,
            backend,
            before,
            state,
            int(trips) if trips is not None else None,
            endpoint,
            tenant,
        ],
    )


def _changed(
    db: Database,
    now: float,
    replica: str,
    backend: str,
    new: Mapping[str, Any],
    old: Mapping[str, Any] | None,
    **scope: str,
) -> None:
    state = text(as_map(new).get("state"))
    before = text(as_map(old).get("state")) if old is not None else None
    if state is not None and state != before:
        _insert(db, now, replica, backend, before, state, num(as_map(new).get("trips")), **scope)


def _endpoints(value: Any) -> dict[str, Mapping[str, Any]]:
    out = {}
    for e in value if isinstance(value, list) else []:
        address = as_map(e).get("address")
        if isinstance(address, str):
            out[address] = as_map(as_map(e).get("breaker"))
    return out


def _tripped(b: Mapping[str, Any]) -> dict[str, dict[str, Mapping[str, Any]]]:
    """``backend`` or ``backend/model`` label -> tenant -> its breaker (not closed)."""
    out = {
        "": {
            str(t): as_map(v)
            for t, v in as_map(as_map(b.get("tenant_breakers")).get("tripped")).items()
        }
    }
    for model, r in as_map(b.get("route_breakers")).items():
        out[f"/{model}"] = {
            str(t): as_map(v)
            for t, v in as_map(as_map(as_map(r).get("tenant_breakers")).get("tripped")).items()
        }
    return out


def record(
    db: Database,
    now: float,
    replica: str,
    backend: str,
    b: Mapping[str, Any],
    old: Mapping[str, Any],
) -> None:
    """Every transition between the previous report ``old`` and this one ``b`` of ``backend``."""
    _changed(
        db,
        now,
        replica,
        backend,
        as_map(b.get("breaker")),
        as_map(old.get("breaker")) if old else None,
    )
    before = _endpoints(old.get("endpoints")) if old else {}
    for address, br in _endpoints(b.get("endpoints")).items():
        _changed(
            db, now, replica, backend, br, before.get(address) if old else None, endpoint=address
        )
    was = _tripped(old) if old else {}
    for suffix, tenants in _tripped(b).items():
        prior = was.get(suffix, {})
        for tenant, br in tenants.items():
            # A tenant first seen tripped was closed before (the only state not reported).
            _changed(
                db,
                now,
                replica,
                backend + suffix,
                br,
                prior.get(tenant, {"state": "closed"}),
                tenant=tenant,
            )
        for tenant in prior.keys() - tenants.keys():
            _insert(
                db,
                now,
                replica,
                backend + suffix,
                text(prior[tenant].get("state")),
                "closed",
                num(prior[tenant].get("trips")),
                tenant=tenant,
            )


def history(store: Store, since: float, limit: int = 200) -> list[dict[str, Any]]:
    return store.query(
        "SELECT * FROM breaker_events WHERE at >= ? ORDER BY at DESC LIMIT ?", [since, limit]
    )
