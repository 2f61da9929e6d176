"""The ``backends`` section's parser behind ``build_policy``: each backend (a single address
or a pool of endpoints), its models, engine metrics, and the settings read per backend.
It reports through the shared ``Reader``, as ``schema_parse`` does for the other sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.policy.engine_metrics import KINDS, PRESETS, parse_selector
from extproc.policy.model import (
    ENGINE_PRIORITIES,
    KV_RESERVATIONS,
    TPM_PRECHARGES,
    AdaptiveSettings,
    Backend,
    BreakerSettings,
    Endpoint,
    Model,
    PlacementSettings,
    WatermarkSettings,
)
from extproc.policy.reader import Path, Reader, read_flat
from extproc.policy.schema_budget import read_money, read_price

KNOWN_ENCODINGS = ("cl100k_base", "o200k_base")
ENGINES = tuple(PRESETS)


def _metric_names(r: Reader, m: Mapping[str, Any], path: Path) -> dict[str, tuple[str, ...]]:
    raw = r.get(m, path, "metric_names", dict, {})
    out: dict[str, tuple[str, ...]] = {}
    for kind, names in raw.items():
        p = (*path, "metric_names", str(kind))
        if kind not in KINDS:
            r.fail(p, f"unknown metric kind (known: {', '.join(KINDS)})")
        elif not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            r.fail(p, "expected a list of metric names, tried in order")
        else:
            bad = False
            for j, n in enumerate(names):
                try:
                    parse_selector(n)
                except ValueError as exc:
                    r.fail((*p, j), str(exc))
                    bad = True
            if not bad:
                out[kind] = tuple(names)
    return out


_BACKEND_FIELDS = ("name", "address", "max_concurrency", "models", "metrics_url", "engine", "metric_names",
                   "watermark", "breaker", "kv_capacity_tokens", "kv_block_size", "kv_overcommit",
                   "kv_reservation", "learned_quantile", "tpm_precharge", "adaptive_concurrency",
                   "endpoints", "placement", "gpu_hour_cost", "engine_priority")
_ENDPOINT_FIELDS = ("address", "metrics_url", "kv_capacity_tokens", "max_concurrency")


def _address(r: Reader, address: str | None, path: Path) -> tuple[str, int]:
    if address is None:
        return "", 0
    host, _, port_s = address.rpartition(":")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        r.fail((*path, "address"), f"expected host:port, got {address!r}")
        return "", 0
    return host, int(port_s)


def _endpoints(r: Reader, m: Mapping[str, Any], path: Path, max_concurrency: int,
               kv_capacity: int | None) -> tuple[Endpoint, ...]:
    """A pool's endpoints, each with its budgets resolved (its own, else the backend's).

    The list is the policy's today; a discovery source (DNS A records of a headless
    service) would produce the same tuple and hand it to ``extproc.backends.endpoints``."""
    raw = m.get("endpoints")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        r.fail((*path, "endpoints"), "expected a non-empty list of endpoints (address, metrics_url)")
        return ()
    out: list[Endpoint] = []
    seen: set[str] = set()
    for k, item in enumerate(raw):
        ep: Path = (*path, "endpoints", k)
        em = r.mapping(item, ep, _ENDPOINT_FIELDS)
        host, port = _address(r, r.get(em, ep, "address", str), ep)
        e = Endpoint(host=host, port=port, metrics_url=r.get(em, ep, "metrics_url", str, None),
                     kv_capacity_tokens=r.get(em, ep, "kv_capacity_tokens", int, kv_capacity, minimum=1),
                     max_concurrency=r.get(em, ep, "max_concurrency", int, max_concurrency, minimum=1))
        if e.key in seen:
            r.fail((*ep, "address"), f"duplicate endpoint {e.key!r}")
        seen.add(e.key)
        out.append(e)
    return tuple(out)


def pool_totals(endpoints: tuple[Endpoint, ...]) -> tuple[str, int, int, int | None]:
    """A pool's address (its first endpoint's) and admission budget: the sums of its endpoints'
    slots and KV (None when one has no KV capacity); placement checks each endpoint."""
    caps = [e.kv_capacity_tokens for e in endpoints]
    kv = None if any(c is None for c in caps) else sum(c for c in caps if c is not None)
    return endpoints[0].host, endpoints[0].port, sum(e.max_concurrency for e in endpoints), kv


def _backends(r: Reader, doc: Any) -> tuple[Backend, ...]:
    if not isinstance(doc, list) or not doc:
        r.fail(("backends",), "expected a non-empty list of backends")
        return ()
    out = []
    for i, item in enumerate(doc):
        path: Path = ("backends", i)
        m = r.mapping(item, path, _BACKEND_FIELDS)
        name = r.name(m, path)
        max_concurrency = r.get(m, path, "max_concurrency", int, 64, minimum=1)
        kv_capacity = r.get(m, path, "kv_capacity_tokens", int, None, minimum=1)
        endpoints = _endpoints(r, m, path, max_concurrency, kv_capacity)
        if endpoints:
            if "address" in m or "metrics_url" in m:
                r.fail((*path, "endpoints"), "a pool lists address and metrics_url per endpoint, not on the backend")
            host, port, max_concurrency, kv_capacity = pool_totals(endpoints)
        else:
            host, port = _address(r, r.get(m, path, "address", str), path)
        models = []
        raw_models = m.get("models")
        if not isinstance(raw_models, list) or not raw_models:
            r.fail((*path, "models"), "expected a non-empty list of models")
            raw_models = []
        for j, mm in enumerate(raw_models):
            mp: Path = (*path, "models", j)
            mmap = r.mapping(mm, mp, tuple(Model.__dataclass_fields__))
            mname = r.get(mmap, mp, "name", str)
            models.append(Model(
                name=mname or "",
                context_window=r.get(mmap, mp, "context_window", int, minimum=16) or 0,
                encoding=r.get(mmap, mp, "encoding", str, "cl100k_base", choices=KNOWN_ENCODINGS),
                default_max_tokens=r.get(mmap, mp, "default_max_tokens", int, None, minimum=1),
                fallback_model=r.get(mmap, mp, "fallback_model", str, None),
                breaker=read_flat(r, mmap["breaker"], (*mp, "breaker"), BreakerSettings)
                if mmap.get("breaker") is not None else None,
                price=read_price(r, mmap.get("price"), (*mp, "price")),
            ))
        out.append(Backend(
            name=name or "", host=host, port=port,
            max_concurrency=max_concurrency,
            models=tuple(models),
            metrics_url=None if endpoints else r.get(m, path, "metrics_url", str, None),
            kv_capacity_tokens=kv_capacity,
            kv_block_size=r.get(m, path, "kv_block_size", int, 16, minimum=1),
            kv_overcommit=float(r.get(m, path, "kv_overcommit", (int, float), 1.0, minimum=1)),
            engine=r.get(m, path, "engine", str, "vllm", choices=ENGINES),
            metric_names=_metric_names(r, m, path),
            watermark=read_flat(r, m.get("watermark"), (*path, "watermark"), WatermarkSettings),
            breaker=read_flat(r, m.get("breaker"), (*path, "breaker"), BreakerSettings),
            kv_reservation=r.get(m, path, "kv_reservation", str, "worst_case", choices=KV_RESERVATIONS),
            learned_quantile=_quantile(r, m, path),
            tpm_precharge=r.get(m, path, "tpm_precharge", str, "max_tokens", choices=TPM_PRECHARGES),
            adaptive_concurrency=_adaptive(r, m.get("adaptive_concurrency"), (*path, "adaptive_concurrency")),
            endpoints=endpoints,
            placement=read_flat(r, m.get("placement"), (*path, "placement"), PlacementSettings),
            gpu_hour_cost_nanos=read_money(r, m["gpu_hour_cost"], (*path, "gpu_hour_cost"))
            if m.get("gpu_hour_cost") is not None else None,
            engine_priority=r.get(m, path, "engine_priority", str, "off",
                                  choices=ENGINE_PRIORITIES),
        ))
    return tuple(out)


def _quantile(r: Reader, m: Mapping[str, Any], path: Path) -> float:
    q = float(r.get(m, path, "learned_quantile", (int, float), 0.95, minimum=0))
    if not 0 < q <= 1:
        r.fail((*path, "learned_quantile"), "in (0, 1]")
        return 0.95
    return q


def _adaptive(r: Reader, doc: Any, path: Path) -> AdaptiveSettings:
    a = read_flat(r, doc, path, AdaptiveSettings)
    checks = ((a.floor >= 1, "floor", "at least 1"), (a.window_s > 0, "window_s", "must be > 0"),
              (a.min_samples >= 1, "min_samples", "at least 1"), (0 < a.quantile <= 1, "quantile", "in (0, 1]"),
              (0 < a.tolerance <= 1, "tolerance", "in (0, 1]"), (0 < a.smoothing <= 1, "smoothing", "in (0, 1]"),
              (0 < a.min_gradient < 1, "min_gradient", "in (0, 1)"))
    for ok, name, what in checks:
        if not ok:
            r.fail((*path, name), what)
    return a
