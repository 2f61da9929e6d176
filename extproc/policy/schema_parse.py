"""The section parsers behind ``build_policy``: one per top-level section, plus the
cross-section checks. Each reports through the shared ``Reader`` and returns what
it could build, so one pass lists every problem in the document.
"""

from __future__ import annotations

import re
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
    Degrade,
    EdgeSettings,
    Endpoint,
    Gateway,
    Model,
    PlacementSettings,
    Tenant,
    Tier,
    WatermarkSettings,
)
from extproc.policy.reader import NAME, Path, Reader, read_flat

KNOWN_ENCODINGS = ("cl100k_base", "o200k_base")
ENGINES = tuple(PRESETS)
# Rules that can run in shadow mode: decided and recorded, not enforced.
SHADOW_RULES = ("tpm", "rpm", "slots", "queue", "shed", "degrade", "breaker")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _shadow(r: Reader, m: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    raw = r.get(m, path, "shadow", list, [])
    for j, rule in enumerate(raw):
        if rule not in SHADOW_RULES:
            r.fail((*path, "shadow", j), f"unknown rule {rule!r} (known: {', '.join(SHADOW_RULES)})")
    return tuple(x for x in raw if x in SHADOW_RULES)


def _gateway(r: Reader, doc: Any) -> Gateway:
    path: Path = ("gateway",)
    m = r.mapping(doc if doc is not None else {}, path, tuple(Gateway.__dataclass_fields__))
    d = Gateway()
    return Gateway(
        max_body_bytes=r.get(m, path, "max_body_bytes", int, d.max_body_bytes, minimum=1024),
        unknown_paths=r.get(m, path, "unknown_paths", str, d.unknown_paths, choices=("reject", "passthrough")),
        strip_api_key=r.get(m, path, "strip_api_key", bool, d.strip_api_key),
        default_max_tokens=r.get(m, path, "default_max_tokens", int, d.default_max_tokens, minimum=1),
        failure_mode_allow=r.get(m, path, "failure_mode_allow", bool, d.failure_mode_allow),
        message_timeout_ms=r.get(m, path, "message_timeout_ms", int, d.message_timeout_ms, minimum=100),
        image_token_estimate=r.get(m, path, "image_token_estimate", int, d.image_token_estimate, minimum=0),
        shadow=_shadow(r, m, path),
        drain_max_bytes=r.get(m, path, "drain_max_bytes", int, d.drain_max_bytes, minimum=0),
        drain_timeout_s=float(r.get(m, path, "drain_timeout_s", (int, float), d.drain_timeout_s, minimum=0.1)),
        request_headers_timeout_s=float(r.get(m, path, "request_headers_timeout_s", (int, float),
                                              d.request_headers_timeout_s, minimum=0.1)),
        request_timeout_s=float(r.get(m, path, "request_timeout_s", (int, float), d.request_timeout_s,
                                      minimum=1)),
        max_connections=r.get(m, path, "max_connections", int, d.max_connections, minimum=1),
        trusted_proxy_hops=r.get(m, path, "trusted_proxy_hops", int, d.trusted_proxy_hops, minimum=0),
        extproc_health_interval_s=float(r.get(m, path, "extproc_health_interval_s", (int, float),
                                              d.extproc_health_interval_s, minimum=0.1)),
        extproc_unhealthy_threshold=r.get(m, path, "extproc_unhealthy_threshold", int,
                                          d.extproc_unhealthy_threshold, minimum=1),
        state=_state(r, m, path),
        state_fail_closed=r.get(m, path, "state_fail_closed", bool, d.state_fail_closed),
        response_processing=r.get(m, path, "response_processing", str, d.response_processing,
                                  choices=("usage_trailers", "streamed")),
        edge=read_flat(r, m.get("edge"), (*path, "edge"), EdgeSettings),
    )


STATE_SCHEMES = ("redis://", "rediss://", "unix://")


def _state(r: Reader, m: Mapping[str, Any], path: Path) -> str:
    v = r.get(m, path, "state", str, "memory")
    if v != "memory" and not v.startswith(STATE_SCHEMES):
        r.fail((*path, "state"), f"expected memory or a Redis URL ({', '.join(STATE_SCHEMES)}), got {v!r}")
        return "memory"
    return v


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
                   "endpoints", "placement", "engine_priority")
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


# A queued request holds Envoy's reply; Envoy allows at most max_message_timeout
# (120 s in the generated config) and our deadline must answer first.
MAX_QUEUE_WAIT_MS = 110_000


def _queue_wait(r: Reader, t: Mapping[str, Any], path: Path) -> int:
    v = r.get(t, path, "max_queue_wait_ms", int, 0, minimum=0)
    if v > MAX_QUEUE_WAIT_MS:
        r.fail((*path, "max_queue_wait_ms"), f"at most {MAX_QUEUE_WAIT_MS} (Envoy's max_message_timeout)")
    return v


def _fraction(
    r: Reader, t: Mapping[str, Any], path: Path, name: str, default: float | None
) -> float | None:
    v = r.get(t, path, name, (int, float), default)
    if v is None:
        return None
    if isinstance(v, bool) or not 0 <= v <= 1:
        r.fail((*path, name), "a fraction of the KV budget, in [0, 1]")
        return default
    return float(v)


def _tiers(r: Reader, doc: Any) -> dict[str, Tier]:
    fields = tuple(f for f in Tier.__dataclass_fields__ if f != "name")
    m = r.mapping(doc, ("tiers",), tuple(doc)) if isinstance(doc, dict) else r.mapping(doc, ("tiers",), ())
    out: dict[str, Tier] = {}
    for name, item in m.items():
        path: Path = ("tiers", name)
        if not NAME.match(str(name)):
            r.fail(path, f"{name!r} is not a valid tier name")
        t = r.mapping(item, path, fields)
        tpm = r.get(t, path, "tpm", int, minimum=1) or 1
        out[str(name)] = Tier(
            name=str(name),
            priority=r.get(t, path, "priority", int, 0),
            tpm=tpm,
            rpm=r.get(t, path, "rpm", int, minimum=1) or 1,
            burst_tokens=r.get(t, path, "burst_tokens", int, tpm, minimum=1),
            max_concurrency=r.get(t, path, "max_concurrency", int, 1 << 20, minimum=1),
            guaranteed_slots=r.get(t, path, "guaranteed_slots", int, 0, minimum=0),
            burst_slots=r.get(t, path, "burst_slots", int, None, minimum=0),
            max_queue_wait_ms=_queue_wait(r, t, path),
            max_queue_depth=r.get(t, path, "max_queue_depth", int, 0, minimum=0),
            queue_weight=r.get(t, path, "queue_weight", int, 1, minimum=1),
            degrade=read_flat(r, t.get("degrade"), (*path, "degrade"), Degrade),
            shadow=_shadow(r, t, path),
            ttft_p99_ms=r.get(t, path, "ttft_p99_ms", int, None, minimum=1),
            itl_p99_ms=r.get(t, path, "itl_p99_ms", int, None, minimum=1),
            kv_guaranteed=_fraction(r, t, path, "kv_guaranteed", 0.0) or 0.0,
            kv_burst=_fraction(r, t, path, "kv_burst", None),
            revocable=r.get(t, path, "revocable", bool, False),
        )
    if not out:
        r.fail(("tiers",), "at least one tier is required")
    return out


def _tenants(r: Reader, doc: Any, tiers: Mapping[str, Tier]) -> tuple[dict[str, Tenant], dict[str, str]]:
    """The tenants by name, and key hash -> tenant name."""
    by_key: dict[str, str] = {}
    if not isinstance(doc, list):
        r.fail(("tenants",), "expected a list of tenants")
        return {}, by_key
    out: dict[str, Tenant] = {}
    for i, item in enumerate(doc):
        path: Path = ("tenants", i)
        m = r.mapping(item, path, ("name", "tier", "keys", "tpm", "rpm", "max_concurrency"))
        name = r.name(m, path)
        tier = r.get(m, path, "tier", str)
        if tier is not None and tier not in tiers:
            r.fail((*path, "tier"), f"unknown tier {tier!r} (known: {', '.join(sorted(tiers))})")
        keys = m.get("keys")
        hashes: list[str] = []
        if not isinstance(keys, list) or not keys:
            r.fail((*path, "keys"), "expected a non-empty list of key hashes (sha256:<hex>)")
        else:
            for j, k in enumerate(keys):
                if not isinstance(k, str) or not k.startswith("sha256:") or not _HEX64.match(k[7:]):
                    r.fail((*path, "keys", j), "expected sha256:<64 lowercase hex>; store hashes, never keys")
                    continue
                hashes.append(k)
                # Checked here, where i and j still point at the list items in the file.
                if k in by_key and by_key[k] != name:
                    r.fail((*path, "keys", j), f"key already belongs to tenant {by_key[k]!r}")
                by_key.setdefault(k, name or "")
        tenant = Tenant(
            name=name or "", tier=tier or "", key_hashes=tuple(hashes),
            tpm=r.get(m, path, "tpm", int, None, minimum=1),
            rpm=r.get(m, path, "rpm", int, None, minimum=1),
            max_concurrency=r.get(m, path, "max_concurrency", int, None, minimum=1),
        )
        if name in out:
            r.fail((*path, "name"), f"duplicate tenant {name!r}")
        else:
            out[name or f"#{i}"] = tenant
    return out, by_key


# Envoy's request_timeout runs until the request goes upstream, so it includes the time a
# request waits in Sluice's queue: it must leave room for the longest wait plus an upload.
REQUEST_TIMEOUT_MARGIN_S = 10.0


def _cross_checks(r: Reader, backends: tuple[Backend, ...], tiers: Mapping[str, Tier],
                  gateway: Gateway | None = None) -> dict[str, tuple[Backend, Model]]:
    by_model: dict[str, tuple[Backend, Model]] = {}
    if gateway is not None:
        for name, t in tiers.items():
            if not t.max_queue_wait_ms:
                continue
            need = t.max_queue_wait_ms / 1000 + REQUEST_TIMEOUT_MARGIN_S
            if gateway.request_timeout_s < need:
                r.fail(("gateway", "request_timeout_s"),
                       f"must be at least {need:g} s: tier {name!r} queues requests for up to "
                       f"{t.max_queue_wait_ms / 1000:g} s, and Envoy counts that wait in the request's time")
    seen_backends: set[str] = set()
    guaranteed = sum(t.guaranteed_slots for t in tiers.values())
    kv_guaranteed = sum(t.kv_guaranteed for t in tiers.values())
    if kv_guaranteed > 1 + 1e-9:
        r.fail(("tiers",), f"the tiers' kv_guaranteed add up to {kv_guaranteed:g}, "
                           "more than the whole KV budget (1)")
    for i, b in enumerate(backends):
        if b.name in seen_backends:
            r.fail(("backends", i, "name"), f"duplicate backend {b.name!r}")
        seen_backends.add(b.name)
        if guaranteed > b.max_concurrency:
            r.fail(("backends", i, "max_concurrency"),
                   f"tiers guarantee {guaranteed} slots, more than this backend's {b.max_concurrency}")
        for j, mdl in enumerate(b.models):
            if mdl.name in by_model:
                r.fail(("backends", i, "models", j, "name"),
                       f"model {mdl.name!r} is already served by backend {by_model[mdl.name][0].name!r}")
            by_model[mdl.name] = (b, mdl)
    for i, b in enumerate(backends):
        for j, mdl in enumerate(b.models):
            if mdl.fallback_model is not None and mdl.fallback_model not in by_model:
                r.fail(("backends", i, "models", j, "fallback_model"),
                       f"fallback model {mdl.fallback_model!r} is not served by any backend")
            elif mdl.fallback_model == mdl.name:
                r.fail(("backends", i, "models", j, "fallback_model"), "a model cannot fall back to itself")
    return by_model
