"""A pool's line in the status report and its metrics are its endpoints' sums: KV used,
reserved and capacity, running and waiting, the fullest endpoint, how many cannot be read;
never "scrape failing" for the pool's own (absent) metrics URL while its endpoints are fine."""

from __future__ import annotations

from typing import Any

from extproc.backends.scrape import Sample
from extproc.backends.state import BackendState
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.metrics import Metrics
from extproc.service.monitor import refresh_endpoints

A, B = "127.0.0.1:7001", "127.0.0.1:7002"


def pool(metrics: bool = True) -> BackendState:
    eps = [
        {
            "address": a,
            "kv_capacity_tokens": cap,
            **({"metrics_url": f"http://{a}/metrics"} if metrics else {}),
        }
        for a, cap in ((A, 32768), (B, 16384))
    ]
    p = build_policy(
        {
            "backends": [
                {
                    "name": "sim",
                    "max_concurrency": 8,
                    "endpoints": eps,
                    "models": [{"name": "m", "context_window": 8192}],
                }
            ],
            "tiers": {"t": {"tpm": 100000, "rpm": 100}},
            "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}],
        }
    )
    return BackendState.create(p.backends[0], p, 0.0)


def feed(
    be: BackendState, samples: dict[str, Sample], reserved: dict[str, int] | None = None
) -> None:
    assert be.endpoints is not None
    for key, s in samples.items():
        st = be.endpoints.by_key[key]
        st.sample = s
        st.wm.observe(s.kv_usage, s.waiting, 1.0)
        st.kv_in_use = (reserved or {}).get(key, 0)


def rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["address"]: e for e in status["endpoints"]}


def test_a_healthy_pool_reports_its_endpoints_sums() -> None:
    be = pool()
    feed(
        be,
        {
            A: Sample(ok=True, kv_usage=0.5, running=3, waiting=1),
            B: Sample(ok=True, kv_usage=0.75, running=2, waiting=4),
        },
        {A: 1024, B: 2048},
    )
    st = be.status(1.0)
    assert (
        st["scrape_ok"] is True and st["metrics_state"] == "ok" and st["kv_source"] == "endpoints"
    )
    p, eps = st["pool"], rows(st)
    assert p["unreadable"] == 0 and p["endpoints"] == 2 and p["usable"] == 2
    assert eps[A]["kv"]["used_tokens"] == 16384 and eps[B]["kv"]["used_tokens"] == 12288
    assert p["kv_used_tokens"] == 16384 + 12288 == sum(e["kv"]["used_tokens"] for e in eps.values())
    assert p["kv_reserved_tokens"] == 3072 == sum(e["kv"]["reserved_tokens"] for e in eps.values())
    assert p["kv_capacity_tokens"] == 49152 == st["kv"]["capacity_tokens"]
    assert st["kv_usage"] == p["kv_usage"] == (16384 + 12288) / 49152
    assert (p["kv_usage_max"], p["kv_usage_max_endpoint"]) == (0.75, B)
    assert st["running"] == 5 == sum(e["running"] for e in eps.values())
    assert st["waiting"] == 5 == sum(e["waiting"] for e in eps.values())


def test_one_unreadable_endpoint_of_two_is_named_and_the_sums_cover_the_other() -> None:
    be = pool()
    feed(
        be,
        {
            A: Sample(ok=True, kv_usage=0.25, running=1, waiting=0),
            B: Sample(ok=False, state="unreachable", error="ConnectionRefused"),
        },
    )
    st = be.status(1.0)
    p, eps = st["pool"], rows(st)
    assert st["scrape_ok"] is False and st["metrics_state"] == "partial"
    assert p["unreadable"] == 1 and p["unreadable_endpoints"] == [B]
    assert eps[B]["unreadable"] is True and eps[A]["unreadable"] is False
    assert eps[B]["kv_usage"] is None and eps[B]["running"] is None
    assert st["running"] == 1 and st["waiting"] == 0
    assert (
        p["kv_used_tokens"] == 8192 and st["kv_usage"] == 8192 / 32768
    )  # what is known, over what it covers
    feed(
        be,
        {
            A: Sample(ok=False, state="unreachable", error="x"),
            B: Sample(ok=False, state="unreachable"),
        },
    )
    st = be.status(2.0)
    assert (
        st["metrics_state"] == "unreachable"
        and st["pool"]["unreadable"] == 2
        and st["kv_usage"] is None
    )


def test_before_the_first_scrape_nothing_is_failing() -> None:
    st = pool().status(0.0)
    assert st["scrape_ok"] is None and st["metrics_state"] is None and st["pool"]["unreadable"] == 0


def test_endpoints_without_metrics_count_by_their_reservations() -> None:
    be = pool(metrics=False)
    feed(be, {}, None)
    assert be.endpoints is not None
    be.endpoints.by_key[A].kv_in_use = 8192
    st = be.status(1.0)
    assert (
        st["pool"]["unreadable"] == 0
        and st["pool"]["kv_used_tokens"] is None
        and st["kv_usage"] is None
    )


def test_the_pool_series_are_the_sums() -> None:
    m, be = Metrics(), pool()
    feed(
        be,
        {
            A: Sample(ok=True, kv_usage=0.5, running=3, waiting=1),
            B: Sample(ok=False, state="unreachable"),
        },
    )
    refresh_endpoints(m, "sim", be, 1.0)

    def gauge(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {"backend": "sim", **labels})

    assert gauge("sluice_backend_kv_usage") == 16384 / 32768
    assert gauge("sluice_backend_requests_waiting") == 1
    assert gauge("sluice_pool_endpoints", state="total") == 2
    assert gauge("sluice_pool_endpoints", state="unreadable") == 1
    assert gauge("sluice_pool_endpoints", state="usable") == 1  # the unreachable one is ejected
