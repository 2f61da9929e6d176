"""Backpressure end to end: KV-aware admission, watermark feedback, breakers, the queue.

The simulated backend has a 4,096-token KV cache (256 blocks of 16) and runs 5x
faster than real time, so a burst of long prompts overruns it within seconds.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml

from extproc.policy.schema import hash_key
from tests.e2e.harness import Proc, Stack, free_port, get_json, running, wait_http
from tests.waiting import eventually

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
KV_BLOCKS, BLOCK = 256, 16
SIM_ARGS = ["--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--time-scale", "5",
            "--max-num-seqs", "64", "--max-model-len", "4096"]
KEYS = {"premium": "sk-bp-premium", "free": "sk-bp-free", "batch": "sk-bp-batch", "q": "sk-bp-q"}


def policy(port: int) -> dict[str, Any]:
    queue = {"max_queue_wait_ms": 20000, "max_queue_depth": 64}
    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 128, "message_timeout_ms": 5000},
        "backends": [{
            "name": "sim", "address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
            "max_concurrency": 16, "kv_capacity_tokens": KV_BLOCKS * BLOCK, "kv_block_size": BLOCK,
            "watermark": {"high": 0.85, "low": 0.70, "floor": 0.6, "recover_per_s": 0.2, "smoothing": 1.0,
                          "scrape_interval_s": 0.1, "stale_after_s": 3},
            "breaker": {"consecutive_failures": 3, "min_requests": 50, "window_s": 10, "cooldown_s": 1,
                        "max_cooldown_s": 4, "ramp_steps": [0.5, 1.0], "ramp_step_s": 0.5,
                        "trip_on_preemption": False},
            "models": [{"name": "sim-llama-8b", "context_window": 4096}],
        }],
        "tiers": {
            "premium": {"priority": 100, "tpm": 10_000_000, "rpm": 100_000, "guaranteed_slots": 4,
                        "queue_weight": 4, **queue},
            "free": {"priority": 10, "tpm": 10_000_000, "rpm": 100_000, "burst_slots": 8,
                     "degrade": {"clamp_max_tokens": 32, "clamp_below_scale": 0.9}, **queue},
            "batch": {"priority": 0, "tpm": 10_000_000, "rpm": 100_000,
                      "degrade": {"shed_below_scale": 0.9}, **queue},
            "q": {"priority": 5, "tpm": 10_000_000, "rpm": 100_000, "max_queue_wait_ms": 600,
                  "max_queue_depth": 1},
        },
        "tenants": [{"name": f"t-{t}", "tier": t, "keys": [hash_key(k)]} for t, k in KEYS.items()],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("bp"), sim_args=SIM_ARGS)
    s.policy_doc = policy(s.sim_port)
    with running(s):
        yield s


@pytest.fixture(autouse=True)
def calm_backend(stack: Stack) -> Iterator[None]:
    sim_config(stack.sim_url, kv_usage_override=None, fail_status=None)
    wait_scale(stack, lambda s: s == 1.0, timeout=8)
    eventually(lambda: backend_state(stack)["breaker"]["state"] == "closed", 8, "breaker left open by an earlier test")
    yield
    sim_config(stack.sim_url, kv_usage_override=None, fail_status=None)


def sim_config(url: str, **cfg: Any) -> None:
    req = urllib.request.Request(f"{url}/admin/config", data=json.dumps(cfg).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def backend_state(stack: Stack) -> dict[str, Any]:
    return stack.state()["backends"]["sim"]


def settled_backend_state(stack: Stack) -> dict[str, Any]:
    """The backend once every answered request has settled: under access_log a response's
    end reaches Sluice in Envoy's next access-log batch, within the settle lag."""
    return stack.wait_settled()["backends"]["sim"]


def wait_scale(stack: Stack, ok: Any, timeout: float = 5.0) -> float:
    seen: list[float] = []

    def check() -> bool:
        seen.append(backend_state(stack)["scale"])
        return bool(ok(seen[-1]))

    eventually(check, timeout, lambda: f"scale {seen[-1]} did not reach the expected value")
    return seen[-1]


def chat(url: str, key: str | None, prompt_words: int = 10, max_tokens: int = 20, tokens: int | None = None,
         extra_headers: dict[str, str] | None = None, timeout: float = 60) -> httpx.Response:
    body = {"model": "sim-llama-8b", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "word " * prompt_words}]}
    headers = {"x-sim-tokens": str(tokens if tokens is not None else max_tokens), **(extra_headers or {})}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(url + CHAT, json=body, headers=headers, timeout=timeout)


def burst(url: str, keys: list[str | None]) -> list[httpx.Response]:
    # Long prompts with long answers: each needs ~1,150 tokens of cache; 12 need 3x the cache.
    with ThreadPoolExecutor(len(keys)) as pool:
        return list(pool.map(lambda k: chat(url, k, prompt_words=900, max_tokens=250), keys))


def test_burst_of_long_prompts_preempts_without_sluice_and_not_with_it(stack: Stack, tmp_path: Any) -> None:
    # Baseline: the same burst straight at an identical backend, no gateway.
    port = free_port()
    bare = Proc("bare-sim", [sys.executable, "-m", "bench.simbackend", "--port", str(port), *SIM_ARGS],
                tmp_path / "bare-sim.log").start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=bare.popen)
        rs = burst(f"http://127.0.0.1:{port}", [None] * 12)
        bare_engine = get_json(f"http://127.0.0.1:{port}/admin/engine")
    finally:
        bare.stop()
    assert all(r.status_code == 200 for r in rs)
    assert bare_engine["preemptions_total"] > 0, bare_engine
    assert bare_engine["kv_blocks_peak"] == KV_BLOCKS, "the bare backend should have filled its cache"

    before = get_json(f"{stack.sim_url}/admin/engine")
    rs = burst(stack.url, [KEYS["premium"]] * 6 + [KEYS["free"]] * 6)
    engine = get_json(f"{stack.sim_url}/admin/engine")
    assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
    assert engine["preemptions_total"] == before["preemptions_total"], engine
    assert engine["kv_blocks_peak"] < KV_BLOCKS, engine
    st = settled_backend_state(stack)
    assert st["kv"]["reserved_tokens"] == 0 and st["slots"]["in_use"] == 0


def test_premium_passes_while_free_is_degraded_and_batch_shed(stack: Stack) -> None:
    sim_config(stack.sim_url, kv_usage_override=0.93)
    wait_scale(stack, lambda s: s <= 0.61)
    stack.clear_sim_requests()
    r = chat(stack.url, KEYS["batch"])
    assert r.status_code == 503 and r.headers["x-sluice-reason"] == "overloaded"
    assert int(r.headers["retry-after"]) >= 1
    r = chat(stack.url, KEYS["free"], max_tokens=200, tokens=200)
    assert r.status_code == 200
    assert r.headers["x-sluice-degraded"] == "max_tokens"
    assert r.json()["usage"]["completion_tokens"] == 32
    r = chat(stack.url, KEYS["premium"], max_tokens=200, tokens=200)
    assert r.status_code == 200 and "x-sluice-degraded" not in r.headers
    assert r.json()["usage"]["completion_tokens"] == 200
    seen = [x["json"]["max_tokens"] for x in stack.sim_requests() if x["path"] == CHAT]
    assert seen == [32, 200], "the batch request must never have reached the backend"


def test_capacity_comes_back_gradually(stack: Stack) -> None:
    sim_config(stack.sim_url, kv_usage_override=0.95)
    wait_scale(stack, lambda s: s <= 0.61)
    sim_config(stack.sim_url, kv_usage_override=None)  # the real usage: an idle cache
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 6:
        seen.append((time.monotonic() - t0, backend_state(stack)["scale"]))
        if seen[-1][1] == 1.0:
            break
        time.sleep(0.1)
    scales = [s for _, s in seen]
    assert scales[-1] == 1.0, seen
    assert scales == sorted(scales), f"recovery must not oscillate: {seen}"
    between = [s for s in scales if 0.65 < s < 0.95]
    assert len(between) >= 5, f"capacity should return in steps, not at once: {seen}"
    assert seen[-1][0] >= 1.5, "recover_per_s 0.2 takes ~2 s from 0.6 to 1.0"


def test_failing_backend_trips_breaker_then_recovers(stack: Stack) -> None:
    sim_config(stack.sim_url, fail_status=500)
    # Failing for two tenants makes it the backend's failure. The first could be
    # premium's alone (another tenant may have succeeded within the window), so the
    # breaker opens on the third failure or on the fourth.
    statuses = [chat(stack.url, KEYS[("premium", "free")[i % 2]]).status_code for i in range(4)]
    assert statuses in ([500, 500, 500, 503], [500, 500, 500, 500]), statuses
    r = chat(stack.url, KEYS["premium"])
    assert r.status_code == 503 and r.headers["x-sluice-reason"] == "breaker_open"
    assert 1 <= int(r.headers["retry-after"]) <= 2
    assert backend_state(stack)["breaker"]["state"] == "open"
    sim_config(stack.sim_url, fail_status=None)
    time.sleep(1.1)  # the cooldown
    results = []
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        r = chat(stack.url, KEYS["premium"])
        results.append((r.status_code, r.headers.get("x-sluice-reason")))
        if backend_state(stack)["breaker"]["state"] == "closed" and r.status_code == 200:
            break
        time.sleep(0.05)
    assert results[0] == (200, None), f"the first request after the cooldown is the probe: {results}"
    assert backend_state(stack)["breaker"]["state"] == "closed", results
    assert all(code in (200, 503) for code, _ in results)
    metrics = stack.metrics_text()
    assert 'sluice_breaker_transitions_total{backend="sim",cause="consecutive_failures"' in metrics or \
        'cause="consecutive_failures",from_state="closed"' in metrics


def test_manual_trip_takes_effect_within_2s(stack: Stack) -> None:
    doc = policy(stack.sim_port)
    doc["breakers"] = [{"backend": "sim", "state": "open", "reason": "draining node for maintenance",
                        "by": "alice"}]
    stack.write_policy(doc)
    r = eventually(lambda: r if (r := chat(stack.url, KEYS["premium"])).status_code == 503 else None, 2.0,
                   "manual trip not applied")
    assert r.headers["x-sluice-reason"] == "breaker_open"
    assert "manual" in r.json()["error"]["message"]
    stack.write_policy(policy(stack.sim_port))
    eventually(lambda: chat(stack.url, KEYS["premium"]).status_code == 200, 4,
               "traffic did not come back after the manual reset", interval=0.1)


def _hold_cache(stack: Stack, pool: ThreadPoolExecutor) -> list[Any]:
    # Two slow requests whose worst-case footprints fill 4,000 of 4,096 cache tokens.
    futs = [pool.submit(chat, stack.url, KEYS["premium"], 400, 1590, 300, {"x-sim-tps": "20"})
            for _ in range(2)]
    eventually(lambda: backend_state(stack)["kv"]["reserved_tokens"] >= 3800, 5, lambda: str(backend_state(stack)),
               interval=0.02)
    return futs


def test_queue_timeout_full_queue_and_disconnect_while_queued(stack: Stack) -> None:
    with ThreadPoolExecutor(4) as pool:
        holders = _hold_cache(stack, pool)
        waiter = pool.submit(chat, stack.url, KEYS["q"], 10, 400)
        eventually(lambda: backend_state(stack)["queue"]["depth"]["q"] == 1, 2, "the request queued", interval=0.01)
        full = chat(stack.url, KEYS["q"], 10, 400)
        assert full.status_code == 429 and full.headers["x-sluice-reason"] == "queue_full"
        timed_out = waiter.result()
        assert timed_out.status_code == 503 and timed_out.headers["x-sluice-reason"] == "queue_timeout"
        assert int(timed_out.headers["retry-after"]) >= 1

        # A client that gives up while queued leaves the queue and holds nothing.
        before = stack.state()["ledger"]
        body = json.dumps({"model": "sim-llama-8b", "max_tokens": 400,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        sock = socket.create_connection(("127.0.0.1", stack.envoy_port))
        sock.sendall((f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['q']}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        eventually(lambda: backend_state(stack)["queue"]["depth"]["q"] == 1, 2, "the request queued", interval=0.01)
        sock.close()
        eventually(lambda: backend_state(stack)["queue"]["depth"]["q"] == 0, 1,
                   "the disconnected request is still queued", interval=0.01)
        after = stack.state()["ledger"]
        assert after["charged"] == before["charged"], "a request that never reached the backend is not billed"
        assert [h.result().status_code for h in holders] == [200, 200]
    st = settled_backend_state(stack)
    assert st["kv"]["reserved_tokens"] == 0 and st["slots"]["in_use"] == 0


def test_metrics_cover_backpressure(stack: Stack) -> None:
    text = stack.metrics_text()
    for name in ("sluice_slots_in_use", "sluice_capacity_scale", "sluice_backend_kv_usage",
                 "sluice_breaker_state", "sluice_queue_depth", "sluice_queue_wait_seconds_bucket",
                 "sluice_degraded_total", "sluice_rejections_total"):
        assert name in text, name
    assert yaml is not None


def test_waiting_premium_request_sheds_batch_and_degrades_free(stack: Stack) -> None:
    with ThreadPoolExecutor(4) as pool:
        holders = _hold_cache(stack, pool)
        waiting = pool.submit(chat, stack.url, KEYS["premium"], 10, 1000, 20)
        eventually(lambda: backend_state(stack)["queue"]["depth"]["premium"] == 1, 2, lambda: str(backend_state(stack)),
                   interval=0.01)
        # The KV watermark is calm (reservations keep it so); the premium queue is the pressure.
        assert backend_state(stack)["scale"] == 1.0
        shed = chat(stack.url, KEYS["batch"])
        assert shed.status_code == 503 and shed.headers["x-sluice-reason"] == "overloaded"
        free = pool.submit(chat, stack.url, KEYS["free"], 10, 200, 200)
        assert waiting.result().status_code == 200
        r = free.result()
        assert r.status_code == 200 and r.headers["x-sluice-degraded"] == "max_tokens"
        assert r.json()["usage"]["completion_tokens"] == 32
        assert [h.result().status_code for h in holders] == [200, 200]
