"""A pool in the status report: each endpoint's row, and the pool's own line, what its
endpoints add up to.

A pool has no metrics URL of its own; its engines' do. Reported as the pool's, the
missing scrape read as "scrape failing, KV unknown" while every endpoint was fine. So a
pool reports the sum of its endpoints instead: KV used (each endpoint's KV fraction
times its capacity, in tokens), reserved and capacity, running and waiting, the
fullest endpoint, and how many endpoints' metrics cannot be read.

Each endpoint's figures are computed once (:func:`endpoint_figures`), and both the
endpoint's row and the pool's sums come from them, so the sums are the rows' sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.backends.endpoints import EndpointSet, EndpointState
from extproc.backends.scrape import Sample, scrape_status


@dataclass(frozen=True)
class EndpointFigures:
    kv_usage: float | None  # the KV fraction shown: the engine's, or the reservations' without one
    kv_used_tokens: int | None  # kv_usage x capacity; None without either
    kv_reserved_tokens: int
    kv_capacity_tokens: int | None
    running: float | None
    waiting: float | None
    unreadable: bool  # scraped, and the answer could not be used (unreachable, or a setup problem)


def endpoint_figures(st: EndpointState) -> EndpointFigures:
    cap = st.spec.kv_capacity_tokens
    has_metrics = st.spec.metrics_url is not None
    kv = scrape_status(st.sample, st.kv_in_use, cap, has_metrics)["kv_usage"]
    sample = st.sample if isinstance(st.sample, Sample) else None
    # A sample that read the exposition (ok, no_series) is readable; none yet is not a failure.
    unreadable = has_metrics and sample is not None and not sample.ok
    return EndpointFigures(
        kv_usage=kv,
        kv_used_tokens=None if kv is None or cap is None else round(kv * cap),
        kv_reserved_tokens=st.kv_in_use,
        kv_capacity_tokens=cap,
        running=sample.running if sample is not None and sample.ok else None,
        waiting=sample.waiting if sample is not None and sample.ok else None,
        unreadable=unreadable,
    )


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def pool_summary(eps: EndpointSet, now: float) -> dict[str, Any]:
    """The pool's sums over its endpoints (draining ones included: they still hold KV)."""
    figs = {key: endpoint_figures(st) for key, st in eps.by_key.items()}
    used = [f.kv_used_tokens for f in figs.values()]
    caps = [f.kv_capacity_tokens for f in figs.values()]
    # The pool's fraction covers the endpoints that have both a reading and a capacity.
    both = [(u, c) for u, c in zip(used, caps, strict=True) if u is not None and c]
    fullest = max(
        ((f.kv_usage, key) for key, f in figs.items() if f.kv_usage is not None), default=None
    )
    unreadable = sorted(key for key, f in figs.items() if f.unreadable)
    return {
        "endpoints": len(figs),
        "usable": sum(1 for st in eps.by_key.values() if st.usable(now)),
        "unreadable": len(unreadable),
        "unreadable_endpoints": unreadable,
        "kv_used_tokens": _total(list(used)),
        "kv_reserved_tokens": sum(f.kv_reserved_tokens for f in figs.values()),
        "kv_capacity_tokens": _total(list(caps)),
        "kv_usage": sum(u for u, _ in both) / sum(c for _, c in both) if both else None,
        "kv_usage_max": None if fullest is None else fullest[0],
        "kv_usage_max_endpoint": None if fullest is None else fullest[1],
        "running": _total([f.running for f in figs.values()]),
        "waiting": _total([f.waiting for f in figs.values()]),
    }


def pool_status_fields(eps: EndpointSet, now: float) -> dict[str, Any]:
    """The fields of a backend's status line that a pool fills from its endpoints (where a
    single engine's come from its own scrape), plus the whole summary under ``pool``."""
    s = pool_summary(eps, now)
    scraped = any(isinstance(st.sample, Sample) for st in eps.by_key.values())
    state = (
        None
        if not scraped
        else "ok"
        if s["unreadable"] == 0
        else "unreachable"
        if s["unreadable"] == s["endpoints"]
        else "partial"
    )
    return {
        "kv_usage": s["kv_usage"],
        "kv_source": "endpoints",
        "metrics_state": state,
        "metrics_problem": None,
        "running": s["running"],
        "waiting": s["waiting"],
        "scrape_ok": None if not scraped else s["unreadable"] == 0,
        "pool": s,
    }


def endpoint_status(st: EndpointState, now: float) -> dict[str, object]:
    """One endpoint in the status report (and so in the console's Overview)."""
    snap = st.breaker.snapshot(now)
    figs = endpoint_figures(st)
    return {
        "address": st.key,
        "destination": st.destination if st.ip is not None else None,
        "draining": st.draining,
        "usable": st.usable(now),
        **scrape_status(
            st.sample, st.kv_in_use, st.spec.kv_capacity_tokens, st.spec.metrics_url is not None
        ),
        "metrics_reason": st.metrics_state(now),
        "unreadable": figs.unreadable,
        "waiting": getattr(st.sample, "waiting", None),
        "running": getattr(st.sample, "running", None),
        "preemptions": getattr(st.sample, "preemptions", None),
        "scale": round(st.scale(now), 4),
        "breaker": {
            "state": snap.get("state"),
            "retry_after_s": snap.get("cooldown_left_s"),
            "trips": snap.get("trips", 0),
            "manual": snap.get("manual"),
        },
        "slots": {"total": st.spec.max_concurrency, "in_use": st.in_flight},
        "kv": {
            "capacity_tokens": st.spec.kv_capacity_tokens,
            "reserved_tokens": st.kv_in_use,
            "used_tokens": figs.kv_used_tokens,
        },
        "repicks": {"away": st.repicked_away, "here": st.repicked_here},
        "lease": None
        if st.leased_slots is None
        else {
            "slots": st.leased_slots,
            "kv": st.leased_kv,
            "others_slots": st.others_slots,
            "others_kv": st.others_kv,
        },
    }


def pool_status(eps: EndpointSet | None, now: float) -> list[dict[str, object]] | None:
    if eps is None:
        return None
    return [endpoint_status(st, now) for st in eps.by_key.values()]


def affinity_status(eps: EndpointSet | None) -> dict[str, object] | None:
    """Prefix affinity of a pool in /debug/state: placements by result and keys remembered."""
    if eps is None or eps.affinity is None:
        return None
    return {**eps.affinity_counts, "keys": len(eps.affinity)}
