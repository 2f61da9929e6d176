"""The monitor's gauges for KV shares, revocations and fair share (docs/long-context.md)."""

from __future__ import annotations

from typing import Any

from extproc.backends.hold import Hold
from extproc.policy.admit import SlotRequest
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.service.monitor import refresh


def policy() -> Any:
    return build_policy(
        {
            "backends": [
                {
                    "name": "b",
                    "address": "127.0.0.1:1",
                    "max_concurrency": 8,
                    "kv_capacity_tokens": 10_000,
                    "models": [{"name": "m", "context_window": 4096}],
                }
            ],
            "tiers": {
                "premium": {"priority": 100, "tpm": 10**6, "rpm": 10**4, "kv_guaranteed": 0.4},
                "batch": {"priority": 0, "tpm": 10**6, "rpm": 10**4, "revocable": True},
            },
            "tenants": [
                {"name": n, "tier": n, "keys": [hash_key(n)]} for n in ("premium", "batch")
            ],
        }
    )


def value(rt: Runtime, name: str, **labels: str) -> float | None:
    return rt.metrics.registry.get_sample_value(name, labels)


def test_refresh_exports_each_tiers_kv_and_the_revocations() -> None:
    rt = Runtime(policy())
    be = rt.backends["b"]
    be.has_metrics = False
    h = be.acquire(SlotRequest("batch", "batch", None, 3000), rt.clock())
    assert isinstance(h, Hold)
    be.shares.revocations.counts[("batch", "streaming")] += 1
    be.shares.revocations._new_counts[("batch", "streaming")] += 1
    be.shares.revocations._new_wasted["batch"] += 700
    refresh(rt)
    assert value(rt, "sluice_kv_reserved_tokens", backend="b", tier="batch") == 3000
    assert value(rt, "sluice_kv_guaranteed_tokens", backend="b", tier="premium") == 4000
    assert value(rt, "sluice_kv_guaranteed_tokens", backend="b", tier="batch") == 0
    assert value(rt, "sluice_revocations_total", backend="b", tier="batch", kind="streaming") == 1
    assert value(rt, "sluice_revoked_work_tokens_total", backend="b", tier="batch") == 700
    assert value(rt, "sluice_fair_share_jain", backend="b", tier="batch") == 1.0
    refresh(rt)  # drained: counted once
    assert value(rt, "sluice_revocations_total", backend="b", tier="batch", kind="streaming") == 1
    be.release(h, rt.clock())
