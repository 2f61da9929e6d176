"""The shared store from the Runtime's side: chosen by the policy or the environment,
shared by two runtimes through the stream path, by three replica processes, and
failing closed with a 503 when Redis is gone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.redis_server import RedisServer
from extproc.policy.gate import LocalState
from extproc.policy.schema import PolicyError, build_policy
from extproc.runtime.runtime import Runtime
from extproc.store import ENV_URL
from extproc.store.redis_state import RedisState
from tests.redis_replicas import server_fixture  # noqa: F401 - the server fixture (a Redis of the test's own)
from tests.redis_server import redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.waiting import eventually_async


def _policy(state: str | None) -> dict[str, object]:
    gw: dict[str, object] = {} if state is None else {"state": state}
    return {"gateway": gw,
            "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 4,
                          "models": [{"name": "m", "context_window": 4096}]}],
            "tiers": {"t": {"priority": 1, "tpm": 1000, "rpm": 10, "max_concurrency": 2}},
            "tenants": [{"name": "a", "tier": "t", "keys": ["sha256:" + "0" * 64]}]}


def test_runtime_picks_the_store_from_the_policy_or_the_environment(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)
    rt = Runtime(build_policy(_policy(None)))
    assert isinstance(rt.state, LocalState) and not rt.shared_state
    rt.close()
    rt = Runtime(build_policy(_policy(redis_server.url)), replica_id="cfg")
    assert isinstance(rt.state, RedisState) and rt.shared_state
    rt.close()
    monkeypatch.setenv(ENV_URL, redis_server.url)
    rt = Runtime(build_policy(_policy("memory")))
    assert isinstance(rt.state, RedisState)
    rt.close()
    with pytest.raises(PolicyError, match="state"):
        build_policy(_policy("postgres://x"))


def test_two_runtimes_share_a_tenants_budget_through_the_stream_path(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through StreamProcessor (the awaited admit in stream.py): what one replica admits, the other cannot."""
    from extproc.policy.schema import hash_key
    from tests.test_stream import body, exchange, headers, response

    monkeypatch.delenv(ENV_URL, raising=False)
    doc = _policy(redis_server.url)
    doc["tiers"] = {"t": {"priority": 1, "tpm": 1000, "rpm": 100}}
    doc["tenants"] = [{"name": "a", "tier": "t", "keys": [hash_key("k")]}]
    doc["gateway"] = {"state": redis_server.url}
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")

    async def main() -> tuple[list[Any], list[Any], list[Any], list[Runtime]]:
        rts = [Runtime(build_policy(doc), replica_id=f"stream{i}") for i in range(2)]
        for rt in rts:
            rt.backends["b"].has_metrics = False
            await rt.first_leases()  # a shared store leases the backend's slots (extproc/store/slot_leases.py)
        first = await exchange(rts[0], hdr, body(10), response(200))
        second = await exchange(rts[1], hdr, body(800), response(200))
        third = await exchange(rts[0], hdr, body(800))
        for rt in rts:
            await rt.state.aclose()  # type: ignore[attr-defined]
        return first, second, third, rts

    first, second, third, rts = asyncio.run(main())
    assert not first[-1].HasField("immediate_response")
    assert not second[-1].HasField("immediate_response")
    refused = third[-1].immediate_response
    assert refused.status.code == 429
    assert {h.header.key: h.header.raw_value for h in refused.headers.set_headers}["x-sluice-reason"] == b"tpm"
    for rt in rts:
        st = rt.status()
        assert st["in_flight"] == 0 and st["ledger"]["balanced"] and st["store"]["up"]
        assert rt.metrics.registry.get_sample_value("sluice_state_store_up") == 1
        rt.close()


def test_three_replica_processes_share_one_budget(redis_server: RedisServer) -> None:
    """Real processes (spawned, each its own connection and event loop), 64 clients in all."""
    from bench.state_store import accuracy

    worst, steady = accuracy(redis_server.url, 3, seconds=4.0)
    assert worst <= 1.02, f"worst window {worst:.3f} x the contract"
    assert steady >= 0.95, f"steady consumption {steady:.3f} x TPM"


def test_fail_closed_answers_503_through_the_stream_path(server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from extproc.policy.schema import hash_key
    from tests.test_stream import body, exchange, headers

    monkeypatch.delenv(ENV_URL, raising=False)
    doc = _policy(server.url)
    doc["tenants"] = [{"name": "a", "tier": "t", "keys": [hash_key("k")]}]
    doc["gateway"] = {"state": server.url, "state_fail_closed": True}
    hdr = headers(_path="/v1/chat/completions", _method="POST", authorization="Bearer k")

    async def main() -> tuple[Any, Runtime]:
        rt = Runtime(build_policy(doc), replica_id="closed-stream")
        rt.backends["b"].has_metrics = False
        await eventually_async(lambda: rt.state.registry.member, 5, "the replica registered in Redis")
        server.kill()
        out = await exchange(rt, hdr, body(10))
        return out[-1].immediate_response, rt

    resp, rt = asyncio.run(main())
    assert resp.status.code == 503
    err = json.loads(resp.body)["error"]
    assert err["code"] == "service_unavailable" and "unreachable" in err["message"]
    assert rt.metrics.registry.get_sample_value("sluice_state_store_up") == 0
    assert rt.status()["in_flight"] == 0
    rt.close()
