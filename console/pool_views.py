"""A pool as the Overview shows it: its own line (the sums over its endpoints, as the replica
reports them under ``pool``), each endpoint's row, and its prefix affinity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from console.report_values import as_map, num, text


@dataclass
class EndpointView:
    """One endpoint of a pool, as the freshest replica reporting it sees it."""

    address: str
    usable: bool = False
    draining: bool = False
    unreadable: bool = False  # its metrics were scraped and could not be used
    kv_usage: float | None = None
    kv_source: str | None = None
    metrics_reason: str | None = None  # ok | kv | queue | stale | unreachable | no_data | ...
    used_tokens: float | None = None
    reserved_tokens: float | None = None
    capacity_tokens: float | None = None
    slots_in_use: float | None = None
    slots_total: float | None = None
    running: float | None = None
    waiting: float | None = None
    scale: float | None = None
    breaker: str | None = None
    # Requests Envoy re-picked off this endpoint (it refused the connection) and onto it.
    repicked_away: float | None = None
    repicked_here: float | None = None


def endpoint_views(value: Any) -> list[EndpointView]:
    out = []
    for e in value if isinstance(value, list) else []:
        e = as_map(e)
        address = e.get("address")
        if not isinstance(address, str):
            continue
        kv, slots, repicks = as_map(e.get("kv")), as_map(e.get("slots")), as_map(e.get("repicks"))
        out.append(
            EndpointView(
                address=address,
                usable=e.get("usable") is True,
                draining=e.get("draining") is True,
                unreadable=e.get("unreadable") is True or e.get("metrics_reason") == "unreachable",
                kv_usage=num(e.get("kv_usage")),
                kv_source=text(e.get("kv_source")),
                metrics_reason=text(e.get("metrics_reason")),
                used_tokens=num(kv.get("used_tokens")),
                reserved_tokens=num(kv.get("reserved_tokens")),
                capacity_tokens=num(kv.get("capacity_tokens")),
                slots_in_use=num(slots.get("in_use")),
                slots_total=num(slots.get("total")),
                running=num(e.get("running")),
                waiting=num(e.get("waiting")),
                scale=num(e.get("scale")),
                breaker=text(as_map(e.get("breaker")).get("state")),
                repicked_away=num(repicks.get("away")),
                repicked_here=num(repicks.get("here")),
            )
        )
    return out


@dataclass
class PoolView:
    """A pool's own line: what its endpoints add up to (``extproc.backends.pool_report``)."""

    endpoints: int = 0
    usable: int = 0
    unreadable: int = 0
    unreadable_endpoints: list[str] = field(default_factory=list)
    kv_used_tokens: float | None = None
    kv_reserved_tokens: float | None = None
    kv_capacity_tokens: float | None = None
    kv_usage: float | None = None
    kv_usage_max: float | None = None
    kv_usage_max_endpoint: str | None = None
    running: float | None = None
    waiting: float | None = None

    @property
    def reserved_share(self) -> float | None:
        if self.kv_reserved_tokens is None or not self.kv_capacity_tokens:
            return None
        return self.kv_reserved_tokens / self.kv_capacity_tokens


def pool_view(value: Any) -> PoolView | None:
    p = as_map(value)
    if not p:
        return None
    bad = p.get("unreadable_endpoints")
    return PoolView(
        endpoints=int(num(p.get("endpoints")) or 0),
        usable=int(num(p.get("usable")) or 0),
        unreadable=int(num(p.get("unreadable")) or 0),
        unreadable_endpoints=[a for a in bad if isinstance(a, str)]
        if isinstance(bad, list)
        else [],
        kv_used_tokens=num(p.get("kv_used_tokens")),
        kv_reserved_tokens=num(p.get("kv_reserved_tokens")),
        kv_capacity_tokens=num(p.get("kv_capacity_tokens")),
        kv_usage=num(p.get("kv_usage")),
        kv_usage_max=num(p.get("kv_usage_max")),
        kv_usage_max_endpoint=text(p.get("kv_usage_max_endpoint")),
        running=num(p.get("running")),
        waiting=num(p.get("waiting")),
    )


@dataclass
class AffinityView:
    """A pool's prefix affinity (``placement.prefix_affinity``): placements by result since
    each replica started (every replica keeps its own map), summed over the fresh reports.

    hit: placed on the endpoint that last served its prefix; spill: that endpoint had no
    room, placed by the score; miss: no part of the prefix was known."""

    hit: int = 0
    spill: int = 0
    miss: int = 0
    keys: int = 0  # prefix block keys remembered, summed over the replicas' maps
    replicas: int = 0

    def add(self, report: Mapping[str, Any]) -> None:
        self.hit += int(num(report.get("hit")) or 0)
        self.spill += int(num(report.get("spill")) or 0)
        self.miss += int(num(report.get("miss")) or 0)
        self.keys += int(num(report.get("keys")) or 0)
        self.replicas += 1

    @property
    def placed(self) -> int:
        return self.hit + self.spill + self.miss

    @property
    def hit_share(self) -> float | None:
        return self.hit / self.placed if self.placed else None


def endpoint_series_key(backend: str, address: str) -> str:
    """The ``backend`` column of an endpoint's KV samples: as its metrics label it."""
    return f"{backend}@{address}"
