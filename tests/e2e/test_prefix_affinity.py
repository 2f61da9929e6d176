"""Prefix affinity end to end: two simulated engines with their prefix cache on, real Envoy.

Four "conversations" (groups), each with its own long system prompt, send one request
per round, concurrently, arriving in a different order every round (rotated). Without
affinity the score places a group wherever there is most room at that moment, so it
keeps landing on the engine that does not hold its prefix; with affinity it returns to
the engine that served it last, whose prefix cache hits: the engines' own counters tell
(tokens found cached, tokens prefilled), measured in the same run; the time to first
token is printed beside them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from extproc.policy.schema import hash_key
from tests.e2e.harness import Stack, eventually, free_port, get_json, running
from tests.e2e.pool_stack import ExtraEngines, engine_url, start_engine

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
BLOCK = 16
BLOCKS = 256  # 4,096 tokens of KV per engine: two of these requests at once, not three
# Prefill is made expensive (400 ms per 1k tokens) so a cache hit is plain in the TTFT printed.
COMMON = ["--block-size", str(BLOCK), "--kv-blocks", str(BLOCKS), "--max-num-seqs", "16", "--max-model-len", "4096",
          "--prefill-ms-per-1k-tokens", "400", "--enable-prefix-caching"]
KEY = "sk-affinity-premium"
GROUPS = 4
ROUNDS = 4
MAX_TOKENS = 32
STAGGER_S = 0.04  # between the arrivals of one round: the order is the one chosen


def policy(a: int, b: int, affinity: bool) -> dict[str, Any]:
    eps = [{"address": f"127.0.0.1:{p}", "metrics_url": f"http://127.0.0.1:{p}/metrics",
            "kv_capacity_tokens": BLOCKS * BLOCK} for p in (a, b)]
    return {
        "gateway": {"max_body_bytes": 1 << 20, "default_max_tokens": 64, "message_timeout_ms": 5000},
        "backends": [{
            "name": "sim", "max_concurrency": 8, "kv_block_size": BLOCK, "endpoints": eps,
            "placement": {"prefix_affinity": affinity, "affinity_min_headroom": 0.2},
            # Real KV usage stays below these: the test is about placement, not the watermark.
            "watermark": {"high": 0.98, "low": 0.96, "smoothing": 1.0, "scrape_interval_s": 0.1,
                          "stale_after_s": 2},
            "models": [{"name": "sim-llama-8b", "context_window": 4096}],
        }],
        "tiers": {"premium": {"priority": 100, "tpm": 100_000_000, "rpm": 1_000_000,
                              "max_queue_wait_ms": 30_000, "max_queue_depth": 64}},
        "tenants": [{"name": "t-premium", "tier": "premium", "keys": [hash_key(KEY)]}],
    }


class TwoEngines(ExtraEngines, Stack):
    engines = ("sim-b",)

    def start_sim(self) -> None:
        self.sim_args = list(COMMON)
        super().start_sim()
        start_engine(self, "sim-b", self.b_port, COMMON, "sim-b.log")

    @property
    def b_url(self) -> str:
        return engine_url(self.b_port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoEngines]:
    s = TwoEngines(tmp_path_factory.mktemp("affinity"))
    s.b_port = free_port()
    s.policy_doc = policy(s.sim_port, s.b_port, affinity=True)
    with running(s):
        yield s


def set_affinity(s: TwoEngines, on: bool) -> None:
    s.write_policy(policy(s.sim_port, s.b_port, on))
    eventually(lambda: (s.state()["backends"]["sim"]["prefix_affinity"] is not None) == on, 10,
               f"prefix affinity {'on' if on else 'off'} after the reload")
    eventually(lambda: all(e["usable"] for e in s.state()["backends"]["sim"]["endpoints"]), 10,
               "both endpoints usable")


def system_prompt(tag: str) -> str:
    return f"You are assistant {tag}. " + "word " * 1400  # ~1,400 tokens, ~7 kB


def ask(s: Stack, system: str, question: str, tps: float | None = None) -> float:
    """One streamed request (decoding at ``tps`` tokens/s if given); returns the seconds until
    its first token arrived."""
    body = {"model": "sim-llama-8b", "max_tokens": MAX_TOKENS, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    headers = {"authorization": f"Bearer {KEY}", "x-sim-tokens": str(MAX_TOKENS)}
    if tps is not None:
        headers["x-sim-tps"] = str(tps)
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", s.url + CHAT, json=body, timeout=60, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))


def engine_hits(s: Stack) -> float:
    return sum(counter(u, "vllm:prefix_cache_hits_total") for u in (s.sim_url, s.b_url))


def engine_prefilled(s: Stack) -> float:
    """Prompt tokens the engines computed: asked for (cached or not) less found cached, as
    vLLM counts them."""
    return sum(counter(u, "vllm:prefix_cache_queries_total") - counter(u, "vllm:prefix_cache_hits_total")
               for u in (s.sim_url, s.b_url))


def affinity_count(s: Stack, result: str) -> float:
    return sum(float(x.split()[-1]) for x in s.metrics_text().splitlines()
               if x.startswith("sluice_prefix_affinity_total{") and f'result="{result}"' in x)


def served_by(s: TwoEngines, tag: str) -> dict[str, int]:
    """How many requests with system prompt ``tag`` each engine served."""
    out = {}
    for name, url in (("a", s.sim_url), ("b", s.b_url)):
        out[name] = sum(1 for x in get_json(f"{url}/admin/requests") if x["path"] == CHAT
                        and x["json"]["messages"][0]["content"].startswith(f"You are assistant {tag}."))
    return out


def run_rounds(s: TwoEngines, phase: str) -> tuple[list[float], float]:
    """ROUNDS rounds of one request per group, rotated order: the TTFTs after the first round,
    and the prompt tokens the engines prefilled (asked less found cached) in those rounds."""
    systems = [system_prompt(f"{phase}-{g}") for g in range(GROUPS)]
    ttfts: list[float] = []
    after_first = 0.0
    with ThreadPoolExecutor(GROUPS) as pool:
        for r in range(ROUNDS):
            order = [(r + i) % GROUPS for i in range(GROUPS)]
            futs = []
            for g in order:
                futs.append(pool.submit(ask, s, systems[g], f"Round {r}, question of group {g}: " + "why " * 60))
                time.sleep(STAGGER_S)
            got = [f.result() for f in futs]
            if r:
                ttfts += got
            else:
                after_first = engine_prefilled(s)
    return ttfts, engine_prefilled(s) - after_first


def test_shared_prefixes_stay_on_their_engine_and_hit_its_cache(stack: TwoEngines) -> None:
    set_affinity(stack, False)
    hits0 = engine_hits(stack)
    off, prefilled_off = run_rounds(stack, "off")
    hits_off = engine_hits(stack) - hits0
    stack.wait_settled()

    set_affinity(stack, True)
    hits0, placed0 = engine_hits(stack), affinity_count(stack, "hit")
    on, prefilled_on = run_rounds(stack, "on")
    hits_on = engine_hits(stack) - hits0
    stack.wait_settled()

    # With affinity, every group stayed on the engine that served its first request...
    for g in range(GROUPS):
        by = served_by(stack, f"on-{g}")
        assert sorted(by.values()) == [0, ROUNDS], (g, by)
    assert affinity_count(stack, "hit") - placed0 >= (ROUNDS - 1) * GROUPS
    # ...so its engine's cache hit for (nearly) its whole system prompt each time after the first.
    assert hits_on >= (ROUNDS - 1) * GROUPS * 1300, hits_on
    # Without affinity the headroom score decides and a group lands where it lands: some of
    # its rounds hit by chance (4k-11k tokens measured under load), never all of them.
    assert hits_on > hits_off, (hits_on, hits_off)
    # What the engines prefilled after the first round, the work a TTFT waits for: with
    # affinity the questions alone (~85 tokens a request), without it most system prompts
    # again (~1,400 each, less the chance hits). The TTFT saved is printed, not asserted:
    # timed by clients on two cores shared with the suite's other modules, a phase the host
    # made late read on 525 ms / off 675 ms in CI with these counters as expected (the
    # TTFT with and without affinity is bench.pool's).
    mean_on, mean_off = sum(on) / len(on), sum(off) / len(off)
    print(f"after the first round: TTFT mean affinity on {mean_on * 1000:.0f} ms, off {mean_off * 1000:.0f} ms; "
          f"tokens prefilled on {prefilled_on:.0f}, off {prefilled_off:.0f}; engine prefix hits (all rounds): "
          f"on {hits_on:.0f}, off {hits_off:.0f}")
    assert 0 < prefilled_on < 0.25 * prefilled_off, (prefilled_on, prefilled_off)


def test_a_full_preferred_engine_spills_to_the_other(stack: TwoEngines) -> None:
    set_affinity(stack, True)
    system = system_prompt("spill")
    ask(stack, system, "warm the cache " * 10)
    home = max(served_by(stack, "spill").items(), key=lambda kv: kv[1])[0]
    spills0 = affinity_count(stack, "spill")
    # Three at once: two fit the home engine with 20 % of its budget left; the third does not.
    # Each decodes for ~1.6 s, so all three are placed while the others hold their KV, however
    # late the host starts the third (a full run once saw all three on the home engine).
    with ThreadPoolExecutor(3) as pool:
        futs = []
        for i in range(3):
            futs.append(pool.submit(ask, stack, system, f"concurrent question {i} " + "how " * 60, 20))
            time.sleep(STAGGER_S)
        for f in futs:
            f.result()
    by = served_by(stack, "spill")
    other = "b" if home == "a" else "a"
    assert by[home] == 3 and by[other] == 1, by
    assert affinity_count(stack, "spill") - spills0 == 1
    stack.wait_settled()


@pytest.fixture(autouse=True)
def restore(stack: TwoEngines) -> Iterator[None]:
    original = copy.deepcopy(stack.policy_doc)
    yield
    stack.write_policy(original)
