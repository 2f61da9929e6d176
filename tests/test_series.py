"""The Prometheus series of a drained endpoint and of a removed backend go (extproc.service.series)."""

from __future__ import annotations

from typing import Any

from extproc.backends.hold import Hold
from extproc.backends.scrape import Sample
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.service.monitor import apply_endpoint_sample, apply_sample, refresh
from extproc.service.series import SeriesPruner, owned, prune
from tests.backend_ops import try_acquire

A, B = "127.0.0.1:7001", "127.0.0.1:7002"


def doc(endpoints: list[str], solo: bool = True) -> dict[str, Any]:
    backends: list[dict[str, Any]] = [{
        "name": "pool", "max_concurrency": 4, "kv_block_size": 10,
        "endpoints": [{"address": a, "metrics_url": f"http://{a}/metrics", "kv_capacity_tokens": 1000}
                      for a in endpoints],
        "models": [{"name": "m", "context_window": 4096, "breaker": {"cooldown_s": 5}}]}]
    if solo:
        backends.append({"name": "solo", "address": "127.0.0.1:7003", "metrics_url": "http://127.0.0.1:7003/m",
                         "max_concurrency": 4, "models": [{"name": "s", "context_window": 4096}]})
    return {"backends": backends, "tiers": {"t": {"tpm": 100000, "rpm": 100}},
            "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}]}


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def series(rt: Runtime) -> str:
    return rt.metrics.render().decode()


def populate(rt: Runtime) -> None:
    """What the monitor and the streams write: every kind of backend-labelled series."""
    m, now = rt.metrics, rt.clock()
    ok = Sample(ok=True, kv_usage=0.4, waiting=1.0, preemptions=0.0)
    for name, be in rt.backends.items():
        apply_sample(m, name, be, ok, now)
        m.ttft.labels(name, "t").observe(0.2)
        if be.endpoints is not None:
            for key, st in be.endpoints.by_key.items():
                apply_endpoint_sample(m, f"{name}@{key}", st, ok, now)
                m.child(m.endpoint_picks, name, key).inc()
                m.metrics_problem.labels(f"{name}@{key}", "http_404").set(0)
    refresh(rt)


def test_a_drained_endpoint_and_a_removed_backend_lose_their_series() -> None:
    clock = Clock()
    rt = Runtime(build_policy(doc([A, B])), clock=clock)
    populate(rt)
    text = series(rt)
    assert f'endpoint="{B}"' in text and f'backend="pool@{B}"' in text and 'backend="solo"' in text
    assert 'backend="pool/m"' in text  # the model route's breaker
    assert prune(rt.metrics, *owned(rt.backends)) == 0 and series(rt) == text  # all still owned

    pool = rt.backends["pool"]
    assert pool.endpoints is not None
    hold = try_acquire(pool, "t", "a", None, 100, 0.0)
    assert isinstance(hold, Hold)
    busy = hold.endpoint
    idle = A if busy == B else B
    rt.swap(build_policy(doc([idle], solo=False)))
    clock.t = 1.0
    refresh(rt)
    assert prune(rt.metrics, *owned(rt.backends)) > 0
    text = series(rt)
    assert 'backend="solo"' not in text, "the removed backend's series are gone"
    # The busy endpoint drains: its series stay while it still serves.
    assert f'endpoint="{busy}"' in text and f'backend="pool@{busy}"' in text
    assert f'endpoint="{idle}"' in text
    pool.release(hold, 1.0)  # the last request on it ends: forgotten
    assert busy not in pool.endpoints.by_key
    prune(rt.metrics, *owned(rt.backends))
    text = series(rt)
    assert busy not in text, [line for line in text.splitlines() if busy in line]
    assert f'endpoint="{idle}"' in text and f'backend="pool@{idle}"' in text and 'backend="pool"' in text

    # An endpoint coming back gets fresh series (the cached child was dropped with its series).
    rt.swap(build_policy(doc([A, B], solo=False)))
    rt.metrics.child(rt.metrics.endpoint_picks, "pool", busy).inc()
    assert rt.metrics.registry.get_sample_value("sluice_endpoint_picks_total",
                                                {"backend": "pool", "endpoint": busy}) == 1.0


def test_a_late_write_of_a_removed_backend_is_pruned_on_the_next_pass() -> None:
    clock = Clock()
    rt = Runtime(build_policy(doc([A])), clock=clock)
    populate(rt)
    rt.swap(build_policy(doc([A], solo=False)))
    pruner = SeriesPruner(interval_s=2.0)
    assert pruner.maybe_prune(rt.metrics, rt.backends, 0.0) > 0
    rt.metrics.ttft.labels("solo", "t").observe(0.3)  # a stream of the old backend settles
    assert pruner.maybe_prune(rt.metrics, rt.backends, 1.0) == 0  # not yet: at most every 2 s
    assert 'backend="solo"' in series(rt)
    assert pruner.maybe_prune(rt.metrics, rt.backends, 2.0) == 1
    assert 'backend="solo"' not in series(rt)
