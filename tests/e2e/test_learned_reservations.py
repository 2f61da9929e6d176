"""Learned KV reservations end to end: more requests share the same cache, none preempted.

One stack; the policy is reloaded from worst_case to learned between two identical
bursts. The worst-case burst also teaches the estimator (completions are learned in
either mode), so the learned burst reserves prompt + ~the real completion length.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from extproc.policy.schema import hash_key
from tests.e2e.harness import Stack, running
from tests.waiting import eventually

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
KV_BLOCKS, BLOCK = 1024, 16  # 16,384 tokens of cache
SIM_ARGS = ["--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK), "--time-scale", "2",
            "--max-num-seqs", "64", "--max-model-len", "4096"]
KEY = "sk-learned"
BURST, MAX_TOKENS, REAL_TOKENS = 32, 800, 200


def policy(port: int, reservation: str) -> dict[str, Any]:
    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 128, "message_timeout_ms": 5000},
        "backends": [{
            "name": "sim", "address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
            "max_concurrency": 64, "kv_capacity_tokens": KV_BLOCKS * BLOCK, "kv_block_size": BLOCK,
            "kv_reservation": reservation,
            "watermark": {"scrape_interval_s": 0.2},
            "models": [{"name": "sim-llama-8b", "context_window": 4096}],
        }],
        "tiers": {"t": {"priority": 1, "tpm": 100_000_000, "rpm": 1_000_000, "max_queue_depth": 64,
                        "max_queue_wait_ms": 60_000}},
        "tenants": [{"name": "tenant", "tier": "t", "keys": [hash_key(KEY)]}],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("learned"), sim_args=SIM_ARGS)
    s.policy_doc = policy(s.sim_port, "worst_case")
    with running(s):
        yield s


def preemptions(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.sim_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert m, "the simulated backend exports vllm:num_preemptions_total"
    return float(m.group(1))


def burst(stack: Stack) -> tuple[int, list[int]]:
    """Fire BURST identical requests at once; returns (peak slots in use, statuses)."""
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, stack.state()["backends"]["sim"]["slots"]["in_use"])
            time.sleep(0.02)

    def one(_: int) -> int:
        body = {"model": "sim-llama-8b", "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": "word " * 50}]}
        r = httpx.post(stack.url + CHAT, json=body, timeout=90,
                       headers={"authorization": f"Bearer {KEY}", "x-sim-tokens": str(REAL_TOKENS)})
        return r.status_code

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            statuses = list(pool.map(one, range(BURST)))
    finally:
        done.set()
        watcher.join()
    return peak, statuses


def wait_reservation(stack: Stack, mode: str, timeout: float = 10.0) -> None:
    eventually(lambda: stack.state()["backends"]["sim"]["kv"]["reservation"] == mode, timeout,
               f"policy with kv_reservation {mode} not loaded")


def test_learned_reservations_run_more_requests_on_the_same_cache_without_preemption(stack: Stack) -> None:
    p0 = preemptions(stack)
    worst_peak, statuses = burst(stack)
    assert statuses == [200] * BURST
    stack.wait_settled(10)
    learned = [e for e in stack.state()["completions"]["estimates"] if e["kind"] == "tenant"]
    assert learned and learned[0]["trusted"] and REAL_TOKENS <= learned[0]["tokens"] < 2 * REAL_TOKENS

    assert stack.policy_doc is not None
    stack.write_policy(policy(stack.sim_port, "learned"))
    wait_reservation(stack, "learned")
    learned_peak, statuses = burst(stack)
    assert statuses == [200] * BURST
    stack.wait_settled(10)

    # Worst case: prompt ~60 + 800 reserved -> 864 tokens each, at most 18 in 16,384.
    assert worst_peak <= (KV_BLOCKS * BLOCK) // 864
    # Learned: prompt + ~212 -> ~60 would fit; the burst's own arrival spread is the limit.
    assert learned_peak >= 1.4 * worst_peak, (worst_peak, learned_peak)
    print(f"peak in flight: worst_case {worst_peak}, learned {learned_peak}")
    assert preemptions(stack) == p0
    stack.write_policy(policy(stack.sim_port, "worst_case"))
    wait_reservation(stack, "worst_case")
