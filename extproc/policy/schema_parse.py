"""The section parsers behind ``build_policy``: one per top-level section (the one for
``backends`` is in ``schema_backends``), plus the cross-section checks. Each reports through
the shared ``Reader`` and returns what it could build, so one pass lists every problem in the
document.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from extproc.policy.model import (
    Backend,
    Degrade,
    EdgeSettings,
    Gateway,
    Model,
    Tenant,
    Tier,
)
from extproc.policy.reader import NAME, Path, Reader, read_flat
from extproc.policy.schema_budget import read_budget, read_currency

# Rules that can run in shadow mode: decided and recorded, not enforced.
SHADOW_RULES = ("tpm", "rpm", "slots", "queue", "shed", "degrade", "breaker", "budget")
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
                                  choices=RESPONSE_PROCESSING),
        edge=read_flat(r, m.get("edge"), (*path, "edge"), EdgeSettings),
        currency=read_currency(r, m, path),
        response_timeout_s=float(r.get(m, path, "response_timeout_s", (int, float),
                                       d.response_timeout_s, minimum=0)),
        access_log_flush_ms=r.get(m, path, "access_log_flush_ms", int, d.access_log_flush_ms, minimum=1),
    )


STATE_SCHEMES = ("redis://", "rediss://", "unix://")
RESPONSE_PROCESSING = ("access_log", "usage_trailers", "streamed")


def _state(r: Reader, m: Mapping[str, Any], path: Path) -> str:
    v = r.get(m, path, "state", str, "memory")
    if v != "memory" and not v.startswith(STATE_SCHEMES):
        r.fail((*path, "state"), f"expected memory or a Redis URL ({', '.join(STATE_SCHEMES)}), got {v!r}")
        return "memory"
    return v


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
            budget=read_budget(r, t.get("budget"), (*path, "budget"), may_disable=False),
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
        m = r.mapping(item, path, ("name", "tier", "keys", "tpm", "rpm", "max_concurrency", "budget"))
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
            budget=read_budget(r, m.get("budget"), (*path, "budget"), may_disable=True),
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
