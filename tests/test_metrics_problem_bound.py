"""Unusable metrics (``problem``) without kv_capacity_tokens count as saturated: nothing else
bounds the cache. With kv_capacity_tokens Sluice's own reservations bound it, as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from extproc.backends.hold import Hold
from extproc.backends.scrape import Sample, kv_source
from extproc.backends.state import BackendState
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.metrics import Metrics
from extproc.service.monitor import apply_endpoint_sample, apply_sample, report_change
from tests.backend_ops import try_acquire

URL = "http://127.0.0.1:1/metrics"
PROBLEM = Sample(ok=False, state="problem", problem="http_404", error="HTTP 404",
                 hint="metrics_url points at no metrics")
OK = Sample(ok=True, kv_usage=0.1, waiting=0.0)


def doc(backend: dict[str, Any]) -> dict[str, Any]:
    return {"backends": [{"name": "b", "max_concurrency": 8, "kv_block_size": 10,
                          "models": [{"name": "m", "context_window": 4096}], **backend}],
            "tiers": {"hi": {"tpm": 100000, "rpm": 100}},
            "tenants": [{"name": "a", "tier": "hi", "keys": [hash_key("a")]}]}


def backend(**extra: Any) -> BackendState:
    p = build_policy(doc({"address": "127.0.0.1:1", "metrics_url": URL, **extra}))
    return BackendState.create(p.backends[0], p, 0.0)


def test_kv_source_of_a_problem_depends_on_a_kv_bound() -> None:
    assert kv_source(PROBLEM, kv_bound=True) == "reservations"
    assert kv_source(PROBLEM, kv_bound=False) == "saturated"
    # The other states do not depend on it: no series yet is idle-but-unknown, not saturated.
    assert kv_source(Sample(ok=True, state="no_series"), kv_bound=False) == "reservations"
    assert kv_source(OK, kv_bound=False) == "engine"


def test_a_problem_without_kv_capacity_holds_the_backend_at_its_floor() -> None:
    m, be = Metrics(), backend()
    apply_sample(m, "b", be, OK, 1.0)
    assert be.scale(1.0) == 1.0
    be.sample = PROBLEM
    apply_sample(m, "b", be, PROBLEM, 2.0)
    assert be.scale(2.0) == be.spec.watermark.floor, "saturated, not admitted without any bound"
    st = be.status(2.0)
    assert st["kv_source"] == "saturated" and st["metrics_problem"]["problem"] == "http_404"


def test_a_problem_with_kv_capacity_admits_by_reservations() -> None:
    m, be = Metrics(), backend(kv_capacity_tokens=1000)
    be.sample = PROBLEM
    apply_sample(m, "b", be, PROBLEM, 1.0)
    assert be.scale(1.0) == 1.0
    assert be.status(1.0)["kv_source"] == "reservations"
    assert isinstance(try_acquire(be, "hi", "a", None, 900, 1.0), Hold)
    assert try_acquire(be, "hi", "a", None, 200, 1.0).reason == "kv_exhausted"  # type: ignore[union-attr]


def test_a_pool_endpoint_with_a_problem_and_no_kv_capacity_is_ejected() -> None:
    p = build_policy(doc({"endpoints": [
        {"address": "127.0.0.1:7001", "metrics_url": "http://127.0.0.1:7001/metrics"},  # no capacity
        {"address": "127.0.0.1:7002", "metrics_url": "http://127.0.0.1:7002/metrics", "kv_capacity_tokens": 4000},
        {"address": "127.0.0.1:7003", "metrics_url": "http://127.0.0.1:7003/metrics"},
    ]}))
    be = BackendState.create(p.backends[0], p, 0.0)
    assert be.endpoints is not None
    m = Metrics()
    eps = be.endpoints.by_key
    apply_endpoint_sample(m, "b@127.0.0.1:7001", eps["127.0.0.1:7001"], PROBLEM, 1.0)
    apply_endpoint_sample(m, "b@127.0.0.1:7002", eps["127.0.0.1:7002"], PROBLEM, 1.0)
    apply_endpoint_sample(m, "b@127.0.0.1:7003", eps["127.0.0.1:7003"], OK, 1.0)
    assert not eps["127.0.0.1:7001"].usable(1.0), "no bound at all: counts as full"
    assert eps["127.0.0.1:7002"].usable(1.0), "its reservations bound it"
    assert eps["127.0.0.1:7003"].usable(1.0)
    picked = {h.endpoint for h in (try_acquire(be, "hi", "a", None, 100, 1.0) for _ in range(6))
              if isinstance(h, Hold)}
    assert "127.0.0.1:7001" not in picked and picked


def test_the_log_line_says_which(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    with caplog.at_level(logging.ERROR, logger="sluice.monitor"):
        report_change(m, "b", URL, OK, PROBLEM, kv_bound=False)
        report_change(m, "c", URL, OK, PROBLEM, kv_bound=True)
    unbound, bound = (r.getMessage() for r in caplog.records)
    assert "Counted as saturated" in unbound and "kv_capacity_tokens" in unbound
    assert "own KV reservations" in bound
