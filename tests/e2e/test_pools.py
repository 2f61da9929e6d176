"""A pool end to end: one backend, two simulated engines of different KV sizes, real Envoy.

Sluice admits against the pool's budget and places each request on an endpoint
where its footprint fits (extproc.policy.placement); Envoy's EDS cluster (its endpoint
set written by extproc --eds-dir) connects to the first ip:port Sluice put in
``x-sluice-endpoint`` and, if that connection is refused, to the second.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml

from extproc.policy.schema import hash_key
from tests.e2e.harness import Stack, eventually, free_port, get_json, running
from tests.e2e.pool_stack import ExtraEngines, engine_url, start_engine

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
BLOCK = 16
SMALL_BLOCKS, BIG_BLOCKS = 128, 256  # 2,048 and 4,096 tokens of KV cache
COMMON = ["--block-size", str(BLOCK), "--time-scale", "5", "--max-num-seqs", "64", "--max-model-len", "4096"]
KEY = "sk-pool-premium"


def endpoint(port: int, blocks: int) -> dict[str, Any]:
    return {"address": f"127.0.0.1:{port}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
            "kv_capacity_tokens": blocks * BLOCK}


def policy(small: int, big: int) -> dict[str, Any]:
    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 128, "message_timeout_ms": 5000},
        "backends": [{
            "name": "sim", "max_concurrency": 16, "kv_block_size": BLOCK,
            "endpoints": [endpoint(small, SMALL_BLOCKS), endpoint(big, BIG_BLOCKS)],
            "watermark": {"smoothing": 1.0, "recover_per_s": 0.5, "scrape_interval_s": 0.1, "stale_after_s": 1},
            "breaker": {"consecutive_failures": 3, "min_requests": 50, "cooldown_s": 1, "max_cooldown_s": 2,
                        "ramp_steps": [1.0], "ramp_step_s": 0.2, "min_failing_tenants": 1},
            "models": [{"name": "sim-llama-8b", "context_window": 4096}],
        }],
        "tiers": {"premium": {"priority": 100, "tpm": 100_000_000, "rpm": 1_000_000,
                              "max_queue_wait_ms": 30_000, "max_queue_depth": 64}},
        "tenants": [{"name": "t-premium", "tier": "premium", "keys": [hash_key(KEY)]}],
    }


class PoolStack(ExtraEngines, Stack):
    """The harness's stack plus a second, bigger engine as the pool's second endpoint."""

    engines = ("sim-big",)

    def start_sim(self) -> None:
        self.sim_args = ["--kv-blocks", str(SMALL_BLOCKS), *COMMON]
        super().start_sim()
        self.start_big()

    def start_big(self) -> None:
        start_engine(self, "sim-big", self.big_port, ["--kv-blocks", str(BIG_BLOCKS), *COMMON],
                     f"sim-big-{time.monotonic_ns()}.log")

    @property
    def big_url(self) -> str:
        return engine_url(self.big_port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolStack]:
    s = PoolStack(tmp_path_factory.mktemp("pool"))
    s.big_port = free_port()
    s.policy_doc = policy(s.sim_port, s.big_port)
    with running(s):
        yield s


def small_key(s: PoolStack) -> str:
    return f"127.0.0.1:{s.sim_port}"


def big_key(s: PoolStack) -> str:
    return f"127.0.0.1:{s.big_port}"


def endpoints(s: Stack) -> dict[str, dict[str, Any]]:
    return {e["address"]: e for e in s.state()["backends"]["sim"]["endpoints"]}


@pytest.fixture(autouse=True)
def both_usable(stack: PoolStack) -> None:
    eventually(lambda: all(e["usable"] for e in endpoints(stack).values()) and len(endpoints(stack)) == 2,
               10, "both endpoints scraped and usable")
    stack.clear_sim_requests()
    clear(stack.big_url)


def clear(url: str) -> None:
    httpx.delete(f"{url}/admin/requests", timeout=5)


def served(url: str) -> int:
    return sum(1 for x in get_json(f"{url}/admin/requests") if x["path"] == CHAT)


def chat(s: Stack, prompt_words: int, max_tokens: int, tokens: int | None = None) -> httpx.Response:
    body = {"model": "sim-llama-8b", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "word " * prompt_words}]}
    return httpx.post(s.url + CHAT, json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}", "x-sim-tokens": str(tokens or max_tokens)})


def preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_preemptions_total"))
    return float(line.split()[-1])


def test_burst_of_long_prompts_fills_both_without_preempting_either(stack: PoolStack) -> None:
    # Each needs ~1,150 tokens of cache: 16 of them are 3x the pool's 6,144 tokens.
    with ThreadPoolExecutor(16) as pool:
        rs = list(pool.map(lambda _: chat(stack, 900, 250), range(16)))
    assert [r.status_code for r in rs] == [200] * 16, [r.text for r in rs if r.status_code != 200]
    small, big = get_json(f"{stack.sim_url}/admin/engine"), get_json(f"{stack.big_url}/admin/engine")
    assert preemptions(stack.sim_url) == 0 and preemptions(stack.big_url) == 0
    assert small["preemptions_total"] == 0 and big["preemptions_total"] == 0
    n_small, n_big = served(stack.sim_url), served(stack.big_url)
    assert n_small + n_big == 16 and n_small >= 2 and n_big >= 4, (n_small, n_big)
    assert n_big > n_small, "the bigger cache takes more of the burst"
    picks = {line.split('endpoint="')[1].split('"')[0]: float(line.split()[-1])
             for line in stack.metrics_text().splitlines() if line.startswith("sluice_endpoint_picks_total{")}
    assert picks[small_key(stack)] >= n_small and picks[big_key(stack)] >= n_big, picks
    # Both were filled (each held at least one long request at once) but never overrun.
    assert small["kv_blocks_peak"] >= 70 and big["kv_blocks_peak"] >= 140, (small, big)
    assert small["kv_blocks_peak"] < SMALL_BLOCKS and big["kv_blocks_peak"] < BIG_BLOCKS


def test_long_request_goes_to_the_endpoint_with_room(stack: PoolStack) -> None:
    with ThreadPoolExecutor(2) as pool:
        # ~3,600 tokens fit only the big endpoint; it holds it for ~5 s.
        hog = pool.submit(chat, stack, 900, 2700)
        eventually(lambda: endpoints(stack)[big_key(stack)]["kv"]["reserved_tokens"] > 3000, 10,
                   "the big endpoint holds the long request")
        assert endpoints(stack)[small_key(stack)]["kv"]["reserved_tokens"] == 0
        # ~1,500 tokens: more than the big one has left, less than the small one's cache.
        r = chat(stack, 900, 500)
        assert r.status_code == 200, r.text
        assert served(stack.sim_url) == 1, "the long request went to the endpoint with room"
        assert hog.result().status_code == 200
    assert served(stack.big_url) == 1


def test_removing_an_endpoint_drains_it(stack: PoolStack) -> None:
    original = copy.deepcopy(stack.policy_doc)
    assert original is not None
    with ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(chat, stack, 900, 2500)  # only the big one holds it: ~5 s there
        eventually(lambda: endpoints(stack)[big_key(stack)]["slots"]["in_use"] == 1, 10, "the long one started")
        doc = copy.deepcopy(original)
        doc["backends"][0]["endpoints"] = doc["backends"][0]["endpoints"][:1]
        try:
            stack.write_policy(doc)
            eventually(lambda: endpoints(stack)[big_key(stack)]["draining"], 10, "the policy reloaded")
            gone = endpoints(stack)[big_key(stack)]
            assert gone["draining"] and not gone["usable"] and gone["slots"]["in_use"] == 1
            rs = [chat(stack, 20, 20) for _ in range(5)]
            assert [r.status_code for r in rs] == [200] * 5
            assert served(stack.sim_url) == 5 and served(stack.big_url) == 1, "no new request to the drained one"
            assert inflight.result().status_code == 200, "the in-flight request finished"
            eventually(lambda: big_key(stack) not in endpoints(stack), 5, "the drained endpoint is forgotten")
            # ... and so are its Prometheus series (extproc.service.series prunes every 2 s).
            eventually(lambda: big_key(stack) not in stack.metrics_text(), 10, "the drained endpoint's series gone")
        finally:
            stack.write_policy(original)
    eventually(lambda: big_key(stack) in endpoints(stack), 10, "the endpoint is back after the reload")


def eds_hosts(s: Stack) -> set[str]:
    """The ip:port in Envoy's endpoint set of the pool (the file extproc --eds-dir writes)."""
    (cla,) = yaml.safe_load((s.eds_dir / "sim.eds.yaml").read_text())["resources"]
    return {f"{a['address']}:{a['port_value']}" for loc in cla.get("endpoints", []) for e in loc["lb_endpoints"]
            for a in [e["endpoint"]["address"]["socket_address"]]}


def repicks(s: Stack) -> dict[tuple[str, str], float]:
    """sluice_endpoint_repicks_total by (from_endpoint, to_endpoint)."""
    out = {}
    for line in s.metrics_text().splitlines():
        if line.startswith("sluice_endpoint_repicks_total{"):
            labels = dict(x.split("=", 1) for x in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["from_endpoint"].strip('"'), labels["to_endpoint"].strip('"'))] = float(line.split()[-1])
    return out


def test_an_endpoint_refusing_connections_is_re_picked_and_ejected_by_its_breaker(stack: PoolStack) -> None:
    """An endpoint whose serving port refuses connections while its metrics read fresh (its
    metrics_url is the big engine's exposition): Envoy retries each connect failure once on
    Sluice's second choice, so every client gets 200; extproc moves the hold to where it ran,
    the refused endpoint's breaker hears the failures and opens (not the pool's), and
    after all streams close nothing is held anywhere."""
    original = copy.deepcopy(stack.policy_doc)
    assert original is not None
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    doc = copy.deepcopy(original)
    doc["backends"][0]["endpoints"].append({"address": dead, "kv_capacity_tokens": 100_000,  # most headroom
                                            "metrics_url": f"{stack.big_url}/metrics"})
    n = 12
    try:
        stack.write_policy(doc)
        eventually(lambda: endpoints(stack).get(dead, {}).get("usable"), 10, "the refusing endpoint usable")
        eventually(lambda: dead in eds_hosts(stack), 5, "Envoy's endpoint set has it")
        before = sum(repicks(stack).values())
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: chat(stack, 20, 20), range(n)))
        assert [r.status_code for r in rs] == [200] * n, [r.text for r in rs if r.status_code != 200]
        assert all("x-sluice-upstream" not in r.headers for r in rs)
        assert served(stack.sim_url) + served(stack.big_url) == n, "each ran once, on a live engine"
        moved = {k: v for k, v in repicks(stack).items() if k[0] == dead}
        assert set(moved) <= {(dead, small_key(stack)), (dead, big_key(stack))}, moved
        assert 3 <= sum(moved.values()) - before <= n, moved  # at least the three that open it
        st = endpoints(stack)[dead]
        assert st["breaker"]["trips"] >= 1 and st["breaker"]["state"] in ("open", "half_open"), st
        assert st["metrics_reason"] not in ("unreachable", "stale", "no_data"), "ejected by its breaker alone"
        assert stack.state()["backends"]["sim"]["breaker"]["state"] == "closed", "one endpoint is not the pool"
        stack.wait_settled(10)
        for key, e in endpoints(stack).items():
            assert e["slots"]["in_use"] == 0 and e["kv"]["reserved_tokens"] == 0, (key, e)
    finally:
        stack.write_policy(original)
    eventually(lambda: dead not in endpoints(stack), 10, "the dead endpoint is gone after the reload")
    eventually(lambda: dead not in eds_hosts(stack), 5, "and out of Envoy's set")


def test_an_endpoint_added_at_runtime_is_reachable_through_envoy(stack: PoolStack) -> None:
    """The policy's new endpoint reaches Envoy's endpoint set (extproc --eds-dir) with the
    reload: a host Envoy does not know would be skipped (round robin over the others)."""
    original = copy.deepcopy(stack.policy_doc)
    assert original is not None
    port = free_port()
    start_engine(stack, "sim-extra", port, ["--kv-blocks", str(BIG_BLOCKS * 4), *COMMON], f"sim-extra-{port}.log")
    doc = copy.deepcopy(original)
    doc["backends"][0]["endpoints"].append(endpoint(port, BIG_BLOCKS * 4))  # most room: Sluice picks it
    key = f"127.0.0.1:{port}"
    try:
        clear(engine_url(port))
        stack.write_policy(doc)
        eventually(lambda: endpoints(stack).get(key, {}).get("usable"), 10, "the new endpoint scraped and usable")
        assert key in eds_hosts(stack)
        rs = [chat(stack, 20, 20) for _ in range(4)]
        assert [r.status_code for r in rs] == [200] * 4
        assert served(engine_url(port)) == 4 and served(stack.sim_url) + served(stack.big_url) == 0
        assert not any(k[0] == key or k[1] == key for k in repicks(stack)), "served where Sluice put it"
    finally:
        stack.write_policy(original)
        eventually(lambda: key not in endpoints(stack), 10, "the extra endpoint gone after the reload")
        stack.procs.pop("sim-extra").stop()


def test_an_endpoint_that_stops_answering_is_ejected(stack: PoolStack) -> None:
    stack.procs["sim-big"].stop()
    try:
        eventually(lambda: not endpoints(stack)[big_key(stack)]["usable"], 5, "the dead endpoint ejected")
        dead = endpoints(stack)[big_key(stack)]
        assert dead["metrics_reason"] == "unreachable", dead
        rs = [chat(stack, 200, 50) for _ in range(6)]
        assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
        assert served(stack.sim_url) == 6
    finally:
        stack.start_big()
    eventually(lambda: endpoints(stack)[big_key(stack)]["usable"], 10, "the endpoint is back once it answers")
    r = chat(stack, 900, 2500, tokens=10)  # only the big one holds this footprint
    assert r.status_code == 200
    assert served(stack.big_url) == 1


def test_a_manually_tripped_endpoint_gets_no_traffic_and_a_reset_brings_it_back(stack: PoolStack) -> None:
    original = copy.deepcopy(stack.policy_doc)
    assert original is not None
    override = {"backend": "sim", "endpoint": big_key(stack), "state": "open", "reason": "bad GPU"}
    doc = copy.deepcopy(original)
    doc["breakers"] = [override]
    try:
        stack.write_policy(doc)
        eventually(lambda: not endpoints(stack)[big_key(stack)]["usable"], 10, "the trip reached the replica")
        tripped = endpoints(stack)[big_key(stack)]
        assert tripped["breaker"]["state"] == "open" and tripped["breaker"]["manual"]["reason"] == "bad GPU"
        assert tripped["metrics_reason"] not in ("unreachable", "stale"), "ejected by the trip, not its metrics"
        # The big endpoint has the most room and would take these; tripped, the small one serves all.
        rs = [chat(stack, 200, 50) for _ in range(6)]
        assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
        assert served(stack.sim_url) == 6 and served(stack.big_url) == 0
        assert stack.state()["backends"]["sim"]["breaker"]["state"] == "closed", "the pool's breaker is untouched"

        doc["breakers"] = [{**override, "state": "closed", "reason": "GPU replaced"}]
        stack.write_policy(doc)
        eventually(lambda: endpoints(stack)[big_key(stack)]["usable"], 10, "the reset reached the replica")
        assert endpoints(stack)[big_key(stack)]["breaker"]["manual"]["state"] == "closed"
        r = chat(stack, 900, 2500, tokens=10)  # only the big one holds this footprint
        assert r.status_code == 200, r.text
        assert served(stack.big_url) == 1
    finally:
        stack.write_policy(original)
    eventually(lambda: endpoints(stack)[big_key(stack)]["breaker"]["manual"] is None, 10, "automatic again")
