"""The pool benchmark's pure parts: the trace's densest window, its compressed replay,
ratios and means, the configurations' policies (no processes started)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import yaml

from bench import conversations, pool
from bench.conversations import Conversations
from bench.loadgen import Result
from bench.simbackend.openai_fmt import generated_text
from bench.trace import CHAT_MODEL, CHAT_WINDOW, Mix, Request, TraceRow
from bench.trace_window import burst_schedule, densest_window, mean_between, ratio
from extproc.policy.schema import build_policy

# One arrival a second, plus nine more in (20, 22): the densest 2 s start at 20.
ROWS = sorted([TraceRow(float(i), 100 + i, 10 + i) for i in range(40)]
              + [TraceRow(20.0 + k * 0.2, 500, 50) for k in range(1, 10)], key=lambda r: r.t)


def test_densest_window_finds_the_burst() -> None:
    start = densest_window(ROWS, 2.0)
    assert ROWS[start].t == 20.0
    # Ties go to the earliest stretch: evenly spaced rows start at the first one.
    even = [TraceRow(float(i), 1, 1) for i in range(10)]
    assert densest_window(even, 3.0) == 0
    assert densest_window(even, 100.0) == 0
    with pytest.raises(ValueError):
        densest_window([], 5.0)
    with pytest.raises(ValueError):
        densest_window(even, 0)


def test_densest_window_is_half_open() -> None:
    # Three rows at 0, 1, 2 and three at 10, 10.5, 11: a 2 s window holds 2 of the first
    # (2 is excluded from [0, 2)) but all 3 of the second.
    rows = [TraceRow(t, 1, 1) for t in (0.0, 1.0, 2.0, 10.0, 10.5, 11.0)]
    assert densest_window(rows, 2.0) == 3


def test_burst_schedule_compresses_the_window_and_keeps_the_gaps() -> None:
    mix = Mix(premium_share=0.25, batch_share=0.0)
    start = densest_window(ROWS, 2.0)
    reqs = burst_schedule(ROWS, start, 2.0, 3.0, mix, seed=1)
    inside = [r for r in ROWS if 20.0 <= r.t < 22.0]
    assert len(inside) == 11
    assert len(reqs) == len(inside)
    assert [r.at for r in reqs] == pytest.approx([(r.t - 20.0) / 3.0 for r in inside])
    assert max(r.at for r in reqs) < 2.0 / 3.0
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert [r.prompt_tokens for r in reqs] == [r.prompt for r in inside]
    assert all(r.tier in ("premium", "free") and r.gen_tokens <= r.max_tokens for r in reqs)
    assert reqs == burst_schedule(ROWS, start, 2.0, 3.0, mix, seed=1)
    with pytest.raises(ValueError):
        burst_schedule(ROWS, start, 2.0, 0.0, mix)


def test_burst_schedule_deals_tiers_by_share_and_clips_to_the_window() -> None:
    rows = [TraceRow(i * 0.01, 50_000 if i == 0 else 100, 2000) for i in range(4000)]
    reqs = burst_schedule(rows, 0, 40.0, 3.0, Mix(premium_share=0.2, batch_share=0.0), seed=5)
    share = sum(r.tier == "premium" for r in reqs) / len(reqs)
    assert 0.17 < share < 0.23
    # Prompts are clipped to the chat window minus the tier's max_tokens, completions to max_tokens.
    assert reqs[0].prompt_tokens + reqs[0].max_tokens <= CHAT_WINDOW
    assert all(r.completion == r.max_tokens for r in reqs)


def test_ratio_and_mean_between() -> None:
    assert ratio(3.0, 2.0) == 1.5
    for bad in ((None, 1.0), (1.0, None), (1.0, 0.0), (math.nan, 1.0), (1.0, math.nan)):
        assert math.isnan(ratio(*bad))
    samples = [(0.0, 1.0), (1.0, 0.5), (2.0, 0.25), (3.0, 0.0)]
    assert mean_between(samples, 1.0, 3.0) == pytest.approx(0.375)
    assert math.isnan(mean_between(samples, 5.0, 6.0))


def test_every_runnable_placement_builds_a_valid_policy() -> None:
    ports = [9001, 9002, 9003]
    for name in ("round_robin", "least_request", "sluice"):
        p = pool.PLACEMENTS[name]
        assert pool.unavailable(p) is None
        built = build_policy(pool.policy(ports, p))
        be = built.backends[0]
        caps = sum(b * pool.BLOCK for b in pool.ENGINES)
        assert be.kv_capacity_tokens == caps
        assert be.max_concurrency == pool.SLOTS * len(ports)
        assert len(be.endpoints) == (3 if p.lb is None else 0)
        assert set(built.tiers) == {"premium", "free"}
        assert built.tiers["premium"].priority > built.tiers["free"].priority


def test_envoy_placements_balance_a_static_cluster_and_sluice_follows_its_header(tmp_path: Path) -> None:
    ports = [9001, 9002, 9003]
    for name, lb in (("round_robin", "ROUND_ROBIN"), ("least_request", "LEAST_REQUEST"), ("sluice", None)):
        doc = pool.policy(ports, pool.PLACEMENTS[name])
        eds = tmp_path / name
        cfg = pool.envoy_config(doc, ports, pool.PLACEMENTS[name].lb, 1, 2, 3, 4, eds)
        c = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "sim")
        if lb:
            assert c["type"] == "STATIC" and c["lb_policy"] == lb
            assert "load_balancing_policy" not in c and "eds_cluster_config" not in c
            hosts = [e["endpoint"]["address"]["socket_address"]["port_value"]
                     for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
            assert hosts == ports
            assert not eds.exists()
        else:
            assert c["type"] == "EDS" and "load_balancing_policy" in c
            path = c["eds_cluster_config"]["eds_config"]["path_config_source"]["path"]
            (cla,) = yaml.safe_load(Path(path).read_text())["resources"]
            hosts = [
                e["endpoint"]["address"]["socket_address"]["port_value"] for e in cla["endpoints"][0]["lb_endpoints"]
            ]
            assert Path(path).parent == eds and sorted(hosts) == ports


def test_prefix_affinity_runs_and_every_engine_caches_prefixes() -> None:
    hook = pool.PLACEMENTS["sluice_prefix"]
    assert hook.lb is None and hook.backend == {"placement": {"prefix_affinity": True}}
    assert pool.unavailable(hook) is None
    assert build_policy(pool.policy([1, 2, 3], hook)).backends[0].placement.prefix_affinity
    sticky = build_policy(pool.policy([1, 2, 3], pool.PLACEMENTS["sluice_prefix_sticky"])).backends[0].placement
    assert sticky.prefix_affinity and sticky.affinity_min_headroom == 0.0
    assert "sluice_prefix_sticky" not in pool.CONFIGS and set(pool.CONFIGS) < set(pool.PLACEMENTS)
    # The cache is on in every configuration, so the comparison isolates placement.
    for p in pool.PLACEMENTS.values():
        assert "--enable-prefix-caching" in pool.sim_args(512, p, 1.0)
    flagged = pool.Placement("x", None, sim=("--no-such-engine-flag",))
    assert "--no-such-engine-flag" in (pool.unavailable(flagged) or "")
    assert pool.unavailable(pool.Placement("y", None, blocked="z")) == "it needs z"


def test_prefix_hit_rates_per_engine_and_pooled() -> None:
    run = pool.Run("sluice", "s", engines=[{"prefix_cache": {"hits_tokens": 30, "queries_tokens": 100}},
                                           {"prefix_cache": {"hits_tokens": 0, "queries_tokens": 100}},
                                           {"prefix_cache": None}])
    hits = run.prefix_hit_rates()
    assert hits[:2] == [0.3, 0.0] and math.isnan(hits[2]) and hits[3] == pytest.approx(0.15)


def _result(i: int, tier: str, sent: float, first: float, end: float, tokens: int, status: int = 200) -> Result:
    return Result(i, tier, "burst", sent, status=status, head=sent + 0.5 * (first - sent), first=first, end=end,
                  tokens=tokens, done=True)


def _run(name: str, scale: float, preempt: int) -> pool.Run:
    # Premium TTFTs 1 s and 2 s (times ``scale``), one free request refused, one cut at the end.
    results = [_result(0, "premium", 1.0, 1.0 + scale, 9.0, 800), _result(1, "premium", 2.0, 2.0 + 2 * scale, 9.0, 800),
               _result(2, "free", 3.0, 3.5, 9.0, 400), _result(3, "free", 3.0, 3.0, 3.0, 0, status=503),
               Result(4, "free", "burst", 4.0, status=200, head=4.1, first=4.2, end=30.0, tokens=5, gave_up="run_end")]
    engines = [{"preemptions_total": preempt, "kv_blocks_peak": b // 2, "kv_blocks_total": b,
                "prefix_cache": {"hits_tokens": 25 * k, "queries_tokens": 100}} for k, b in enumerate(pool.ENGINES)]
    return pool.Run(name, pool.PLACEMENTS[name].title, results, kv=[[(1.0, 0.5), (5.0, 0.25)]] * 3,
                    engines=engines, window=(0.0, 10.0),
                    affinity={"hit": 5, "spill": 2, "miss": 1} if name == "sluice_prefix" else None)


def test_markdown_reports_per_engine_ratios_and_outcomes() -> None:
    rr, sl, af = _run("round_robin", 2.0, 7), _run("sluice", 1.0, 0), _run("sluice_prefix", 1.0, 0)
    blocked = pool.Run("blocked", "Blocked", error="not run: it needs x (y)")
    cap = pool.Run("capacity", "cap", [_result(9, "premium", 0.0, 0.1, 5.0, 2000)], window=(0.0, 10.0),
                   engines=[{"preemptions_total": 0}] * 3)
    reqs = [Request(i, float(i), "burst", "premium" if i < 2 else "free", CHAT_MODEL, 100, 512, 10) for i in range(5)]
    summary = {"requests": 5, "conversations": 3, "follow_ups": 0.4, "with_system": 0.6, "shared_tokens": 0.25}
    md = pool.markdown(pool.PoolBench(cap, {"round_robin": rr, "sluice": sl, "sluice_prefix": af, "blocked": blocked},
                                      reqs, 1814.0, pool.FULL, summary))
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    # Goodput: (800 + 800 + 400) tokens over the 10 s window; capacity: 2000 over 10 s.
    r, s = rows["Envoy round-robin"], rows["Sluice picking"]
    assert r[1] == "7 / 7 / 7" and s[1] == "0 / 0 / 0"
    assert r[2] == "50 / 50 / 50" and r[3] == "38 / 38 / 38"  # peak blocks / total; mean of the samples in the window
    assert r[4] == s[4] == "200" and r[5] == "100" and r[6] == "1.00"  # 200 tok/s: all of the capacity
    assert r[7] == "2.00 / 4.00" and s[7] == "1.00 / 2.00" and s[8] == "0.50"  # premium TTFT, p99 vs round-robin
    assert r[9] == "2/2" and r[10] == "1/3" and r[11].rstrip(" |") == "0 / 1 / 1 / 0"
    assert rows["Blocked"][1].rstrip(" |") == "not run: it needs x"
    lines = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| ")}
    assert lines["| Blocked"].count("|") == lines["| Envoy round-robin"].count("|")  # as many cells
    # Prefix cache hits per engine (0, 25, 50 of 100 queried tokens) and pooled; affinity counts.
    assert r[12] == "0 / 25 / 50 / 25" and r[13].rstrip(" |") == "off"
    assert rows["Sluice picking + prefix affinity"][13].rstrip(" |") == "5 / 2 / 1"
    assert "3 conversations, 40 % of requests are follow-up turns" in md
    assert "premium response headers p50 / p99 0.50 / 1.00 s" in md  # half the TTFT, as built above


# The conversation-shaped prompts (bench.conversations).

def _schedule(n: int = 400, gap: float = 0.25, seed: int = 3) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, i * gap, "burst", "free", CHAT_MODEL, rng.choice((300, 450, 1500, 2400, 4000)), 512,
                    rng.randint(20, 300)) for i in range(n)]


def _tokens(body: bytes) -> int:
    from bench.simbackend.parse import count_prompt, parse_chat
    from extproc.tokens import encodings

    return count_prompt(parse_chat(json.loads(body)), encodings.get_encoding("cl100k_base"))


def test_conversation_prompts_keep_the_trace_sizes_and_are_deterministic() -> None:
    reqs = _schedule()
    convs = Conversations(reqs)
    for r in reqs[:60]:
        assert _tokens(convs.body(r)) == r.prompt_tokens  # the gateway's and the engine's count
    assert convs.body(reqs[0], stream=False) != convs.body(reqs[0])
    again = Conversations(reqs)
    assert [again.body(r) for r in reqs] == [convs.body(r) for r in reqs]
    other = Conversations(reqs, seed=99)
    assert other.body(reqs[5]) != convs.body(reqs[5])
    tiny = dataclasses.replace(reqs[0], prompt_tokens=3)
    assert _tokens(Conversations([tiny]).body(tiny)) == conversations.MIN_PROMPT


def test_system_prompts_are_shared_and_distinct() -> None:
    reqs = _schedule()
    convs = Conversations(reqs)
    by_system: dict[int, list[list[dict[str, str]]]] = {}
    for r in reqs:
        p = convs.prompts[r.id]
        if p.system is not None:
            by_system.setdefault(p.system, []).append(convs.messages(r.id))
    assert len(by_system) >= 4 and max(len(v) for v in by_system.values()) >= 20  # shared by many requests
    texts = {k: v[0][0]["content"] for k, v in by_system.items()}
    for k, ms in by_system.items():
        assert all(m[0] == {"role": "system", "content": texts[k]} for m in ms)
        words = texts[k].split()
        assert len(words) == conversations.SYSTEM_PROMPTS[k] and len(set(words)) > len(words) // 3  # not one word
    # Different system prompts differ from their first word; first user turns do too.
    firsts = [t.split()[0] for t in texts.values()]
    assert len(set(firsts)) == len(firsts)
    users = [convs.messages(r.id)[-1]["content"] for r in reqs if convs.prompts[r.id].turn == 0]
    assert len({u.split()[0] + u.split()[-1] for u in users}) > 0.9 * len(users)


def test_conversations_grow_by_repeating_the_previous_turn() -> None:
    reqs = _schedule()
    convs = Conversations(reqs)
    by_id = {r.id: r for r in reqs}
    last: dict[int, tuple[Request, list[dict[str, str]]]] = {}
    follow = 0
    for r in reqs:
        p, msgs = convs.prompts[r.id], convs.messages(r.id)
        if p.turn:
            prev, prev_msgs = last[p.conversation]
            follow += 1
            assert r.at - prev.at >= conversations.TURN_GAP_S
            # The previous prompt's messages, the reply the engine gave, then a new user turn.
            assert msgs[:len(prev_msgs)] == prev_msgs
            assert msgs[len(prev_msgs)] == {"role": "assistant", "content": generated_text(0, prev.completion)}
            assert msgs[-1]["role"] == "user" and len(msgs) == len(prev_msgs) + 2
            assert len(msgs[-1]["content"].split()) >= conversations.MIN_TURN
            assert r.prompt_tokens > by_id[prev.id].prompt_tokens
        last[p.conversation] = (r, msgs)
    assert follow > 0.15 * len(reqs)
    assert max(p.turn for p in convs.prompts.values()) >= 2
    s = convs.summary()
    assert s["requests"] == len(reqs) and 0.15 < s["follow_ups"] < 0.7 and s["shared_tokens"] > 0.2


def test_the_words_are_one_token_each_in_both_encodings() -> None:
    from extproc.tokens import encodings

    vocab = conversations.vocabulary()
    assert len(vocab) == conversations.VOCAB and len(set(vocab)) == len(vocab)
    text = conversations.words("k", 3000)
    for name in ("cl100k_base", "o200k_base"):
        assert len(encodings.get_encoding(name).encode_ordinary(text)) == 3000
