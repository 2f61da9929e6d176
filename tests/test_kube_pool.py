"""A pool's endpoints from the cluster: the pure reading of an InferencePool and its pods, and
the watcher with the real ``kubernetes`` client against the API's list and watch served over
HTTP (tests/kube_api.py), on a real Runtime."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from extproc.backends.inference_pool import objective_tiers, ready_addresses, with_endpoints
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime
from extproc.service.kube_pool import ClusterPool, PoolRef, api_client
from tests.kube_api import KubeApi, fixture, pod
from tests.waiting import eventually_async

APP = {"app": "vllm"}


def policy_doc() -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "pool",
                "max_concurrency": 8,
                "endpoints": [
                    {
                        "address": "vllm.default.svc:8000",
                        "metrics_url": "http://vllm.default.svc:8000/metrics",
                        "kv_capacity_tokens": 50_000,
                        "max_concurrency": 16,
                    }
                ],
                "models": [{"name": "m", "context_window": 4096}],
            },
            {"name": "other", "address": "127.0.0.1:9999", "models": [{"name": "o", "context_window": 4096}]},
        ],
        "tiers": {
            "std": {"priority": 10, "tpm": 100_000, "rpm": 1000},
            "bulk": {"priority": 0, "tpm": 100_000, "rpm": 1000},
        },
        "tenants": [{"name": "a", "tier": "std", "keys": [hash_key("k")]}],
    }


# -- pure ---------------------------------------------------------------------------------
def test_only_running_ready_selected_pods_with_an_ip_are_members() -> None:
    pool = fixture("inferencepool.json")
    gone = pod("gone", "10.0.0.5", APP)
    gone["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    no_ip = pod("no-ip", "", APP)
    pods = [pod("a", "10.0.0.1", APP), pod("b", "10.0.0.2", APP, ready=False), pod("c", "10.0.0.3", {"app": "x"}),
            pod("d", "10.0.0.4", APP, phase="Pending"), gone, no_ip, pod("e", "10.0.0.6", {**APP, "extra": "1"})]
    assert ready_addresses(pool, pods) == ("10.0.0.1:8000", "10.0.0.6:8000")
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    assert ready_addresses(pool, pods[:1]) == ("10.0.0.1:8000", "10.0.0.1:8001")
    pool["spec"]["selector"]["matchLabels"] = {}
    assert ready_addresses(pool, pods) == ()  # an empty selector selects nothing here


def test_discovered_endpoints_take_the_templates_budgets_and_metrics_path() -> None:
    spec = build_policy(policy_doc()).backends[0]
    got = with_endpoints(spec, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert [e.key for e in got.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert [e.metrics_url for e in got.endpoints] == ["http://10.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics"]
    assert got.max_concurrency == 32 and got.kv_capacity_tokens == 100_000  # the pool's totals, re-derived
    assert with_endpoints(spec, []) is spec


def test_a_negative_objective_priority_is_sheddable() -> None:
    p = build_policy(policy_doc())
    shed = fixture("inferenceobjective.json")
    keep = copy.deepcopy(shed)
    keep["metadata"]["name"], keep["spec"]["priority"] = "chat", 3
    elsewhere = copy.deepcopy(shed)
    elsewhere["metadata"]["name"], elsewhere["spec"]["poolRef"]["name"] = "other-pool", "another"
    assert objective_tiers([shed, keep, elsewhere], "sluice-pool", p) == {"batch-summaries": "bulk"}


def test_pool_ref() -> None:
    assert PoolRef.parse("pool=ns/name") == PoolRef("pool", "ns", "name")
    assert PoolRef.parse("pool=name", "here") == PoolRef("pool", "here", "name")
    with pytest.raises(ValueError):
        PoolRef.parse("pool")


# -- the watcher, with the client over HTTP ------------------------------------------------
@pytest.fixture
def api(tmp_path: Path) -> Any:
    a = KubeApi()
    a.put("inferencepools", fixture("inferencepool.json"))
    a.put("pods", pod("p1", "10.0.0.1", APP))
    a.put("inferenceobjectives", fixture("inferenceobjective.json"))
    a.cfg = a.kubeconfig(tmp_path / "kubeconfig")
    yield a
    a.close()


def endpoints(rt: Runtime) -> list[str]:
    eps = rt.backends["pool"].endpoints
    assert eps is not None
    return sorted(k for k, st in eps.by_key.items() if not st.draining)


def test_the_pool_follows_its_pods(api: Any) -> None:
    async def go() -> None:
        rt = Runtime(build_policy(policy_doc()))
        ready: list[bool] = []
        cp = ClusterPool(rt, PoolRef("pool", "default", "sluice-pool"), api_client(str(api.cfg)),
                         on_ready=lambda: ready.append(True))
        assert endpoints(rt) == ["vllm.default.svc:8000"]  # the policy's, until the cluster answers
        cp.start()
        try:
            await eventually_async(lambda: endpoints(rt) == ["10.0.0.1:8000"], 10, "the first pod")
            assert ready == [True]
            assert rt.backends["pool"].spec.max_concurrency == 16
            await eventually_async(lambda: api.watching("pods") == 1, 5, "a pod watch")
            api.put("pods", pod("p2", "10.0.0.2", APP))
            api.put("pods", pod("p3", "10.0.0.3", APP, ready=False))
            await eventually_async(lambda: endpoints(rt) == ["10.0.0.1:8000", "10.0.0.2:8000"], 10, "p2 joining")
            assert rt.backends["pool"].spec.max_concurrency == 32
            api.put("pods", pod("p3", "10.0.0.3", APP, ready=True))
            api.delete("pods", "p1")
            await eventually_async(lambda: endpoints(rt) == ["10.0.0.2:8000", "10.0.0.3:8000"], 10, "p1 leaving")
            # A reload of the policy files keeps what the cluster says.
            rt.swap(build_policy(policy_doc()))
            assert endpoints(rt) == ["10.0.0.2:8000", "10.0.0.3:8000"]
            assert rt.backends["other"].endpoints is None  # every other backend as the policy says
            assert cp.objective_tier("batch-summaries") == "bulk" and cp.objective_tier("chat") is None
            # The pool's selector changes: the same pods, judged again.
            changed = fixture("inferencepool.json")
            changed["spec"]["selector"]["matchLabels"] = {"app": "vllm-v2"}
            api.put("pods", pod("p4", "10.0.0.4", {"app": "vllm-v2"}))
            api.put("inferencepools", changed)
            await eventually_async(lambda: endpoints(rt) == ["10.0.0.4:8000"], 10, "the new selector")
        finally:
            cp.stop()
            api.close()
            rt.close()

    asyncio.run(go())


def test_a_watch_that_ends_is_listed_again(api: Any) -> None:
    async def go() -> None:
        rt = Runtime(build_policy(policy_doc()))
        cp = ClusterPool(rt, PoolRef("pool", "default", "sluice-pool"), api_client(str(api.cfg)), lambda: None)
        cp.start()
        try:
            await eventually_async(lambda: api.watching("pods") == 1, 10, "a pod watch")
            lists = api.lists["pods"]
            with api.lock:  # the server ends the watch (its timeout, a restart)
                for q in api.watchers["pods"]:
                    q.put(None)
            await eventually_async(lambda: api.lists["pods"] > lists and api.watching("pods") == 1, 10,
                                   "a new list and watch")
            api.put("pods", pod("p9", "10.0.0.9", APP))
            await eventually_async(lambda: "10.0.0.9:8000" in endpoints(rt), 10, "a pod added after the resume")
        finally:
            cp.stop()
            api.close()
            rt.close()

    asyncio.run(go())
