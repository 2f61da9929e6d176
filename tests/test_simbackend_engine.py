"""The simulated engine's model, driven by a fake clock: KV blocks, preemption, pacing, chunked prefill."""

from __future__ import annotations

import pytest

from bench.simbackend import SimConfig
from bench.simbackend.engine import Engine, Sequence
from tests.sim_client import drive


# ---- engine, driven by a fake clock ----------------------------------------------------
def test_engine_ample_blocks_never_preempts() -> None:
    e = Engine(SimConfig(kv_blocks=1000, block_size=16))
    seqs = [Sequence(prompt_tokens=300, max_tokens=60) for _ in range(20)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    assert e.preemptions_total == 0
    assert all(s.state == "finished" and s.generated == 60 for s in seqs)
    assert e.free_blocks == e.total_blocks
    assert e.prompt_tokens_total == 20 * 300
    assert e.generation_tokens_total == 20 * 60


def test_engine_runs_out_of_kv_and_preempts() -> None:
    # 64 blocks x 16 = 1024 tokens for 8 sequences that each grow to 400.
    e = Engine(SimConfig(kv_blocks=64, block_size=16))
    seqs = [Sequence(prompt_tokens=200, max_tokens=200, natural_stop=True) for _ in range(8)]
    for s in seqs:
        e.add(s, 0.0)
    _, peak = drive(e)
    assert e.preemptions_total > 0
    assert peak >= 0.95
    # Recompute keeps what was generated: every request still completes in full.
    assert all(s.state == "finished" and s.generated == 200 for s in seqs)
    assert all(s.finish_reason == "stop" for s in seqs)
    assert e.free_blocks == e.total_blocks and not e.running and not e.waiting


def test_engine_preempts_newest_to_front_of_queue() -> None:
    e = Engine(SimConfig(kv_blocks=4, block_size=4, watermark=0.0))
    a, b, c = (Sequence(prompt_tokens=4, max_tokens=10) for _ in range(3))
    for s in (a, b, c):
        e.add(s, 0.0)
    out = e.step(0.0)  # prefill: a and b take 2 blocks each (prompt + first token)
    assert out.kind == "prefill" and e.running == [a, b] and list(e.waiting) == [c]
    now = out.duration
    while not e.preemptions_total:
        now += e.step(now).duration
    # a is older: when it needs a third block, b (newest) is evicted and queued ahead of c.
    assert b.state == "waiting" and list(e.waiting) == [b, c] and b.blocks == 0
    assert a.blocks == 3 and e.free_blocks == 1
    made = b.generated
    drive(e)
    assert b.state == "finished" and b.generated == 10 and b.num_preemptions >= 1 and made > 0


def test_engine_oom_mode_fails_all_running_and_pauses() -> None:
    e = Engine(SimConfig(kv_blocks=16, block_size=16, mode="oom", oom_pause_s=2.0, watermark=0))
    seqs = [Sequence(prompt_tokens=100, max_tokens=200) for _ in range(3)]
    for s in seqs:
        e.add(s, 0.0)
    now, failed = 0.0, []
    while not failed:
        out = e.step(now)
        failed = out.failed
        now += out.duration
    assert {s.state for s in failed} == {"failed"} and failed[0].error[0] == 500
    assert e.oom_failures_total == len(failed) >= 2
    assert e.free_blocks == e.total_blocks and not e.running
    assert e.paused(now)
    late = Sequence(prompt_tokens=10, max_tokens=1)
    e.add(late, now)
    out = e.step(now)
    assert out.kind == "idle" and late.state == "waiting" and out.wake_at == e.paused_until
    e.step(e.paused_until)
    assert late.state in ("running", "finished")


def test_engine_abort_frees_blocks() -> None:
    e = Engine(SimConfig(kv_blocks=100, block_size=16))
    s, w = Sequence(prompt_tokens=500, max_tokens=100), Sequence(prompt_tokens=10, max_tokens=5)
    e.add(s, 0.0)
    e.step(0.0)
    e.add(w, 0.0)
    assert e.used_blocks == 32
    e.abort(s)
    e.abort(w)
    assert e.used_blocks == 0 and not e.running and not e.waiting
    assert s.state == w.state == "aborted"


def test_engine_delay_and_own_pace() -> None:
    e = Engine(SimConfig(kv_blocks=100))
    s = Sequence(prompt_tokens=50, max_tokens=30, delay=1.0, tps=10.0)
    e.add(s, 0.0)
    out = e.step(0.0)
    assert out.kind == "prefill" and s.state == "running" and s.generated == 0
    assert s.blocks > 0  # a delayed request still holds its KV
    out = e.step(out.duration)
    assert out.kind == "idle" and out.wake_at == pytest.approx(1.0)
    out = e.step(1.0)
    assert s.generated == 1
    first = s.first_token_at
    assert first is not None
    # Own pace: about 10 tokens per second after the first, whatever the step rate.
    e.step(first + 1.0 + 1e-6)
    assert s.generated == 11


def test_engine_rejects_prompt_larger_than_cache() -> None:
    e = Engine(SimConfig(kv_blocks=10, block_size=16))
    s = Sequence(prompt_tokens=1000, max_tokens=5)
    e.add(s, 0.0)
    out = e.step(0.0)
    assert out.failed == [s] and s.error is not None and s.error[0] == 400
    assert e.free_blocks == 10


def test_default_pacing_gives_64_chats_30_to_50_tokens_per_second() -> None:
    e = Engine(SimConfig())
    seqs = [Sequence(prompt_tokens=100, max_tokens=400) for _ in range(64)]
    for s in seqs:
        e.add(s, 0.0)
    now = e.step(0.0).duration
    start, gen0 = now, seqs[0].generated
    for _ in range(200):
        now += e.step(now).duration
    rate = (seqs[0].generated - gen0) / (now - start)
    assert 30 <= rate <= 50, rate


# ---- chunked prefill (vLLM V1 scheduling) ----------------------------------------------
def test_chunked_prefill_admits_long_prompts_by_their_first_chunk_and_thrashes() -> None:
    # 256 blocks x 16 = 4096 tokens; three 1,800-token prompts generating 200 each. Whole
    # prompts, only two fit at once; chunk by chunk all three are admitted, and they
    # outgrow the cache: the newest is preempted (recompute) again and again.
    cfg = SimConfig(kv_blocks=256, block_size=16, chunked_prefill=True, max_num_batched_tokens=128)
    e = Engine(cfg)
    seqs = [Sequence(prompt_tokens=1800, max_tokens=200) for _ in range(3)]
    for s in seqs:
        e.add(s, 0.0)
    out = e.step(0.0)  # the first chunk of the first prompt takes the whole budget
    assert out.kind == "prefill" and e.running == [seqs[0]] and seqs[0].prefill_left == 1672
    assert seqs[0].blocks == 8 and not out.emitted
    assert out.duration == pytest.approx((cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 0.128) / 1000)
    now, peak = drive(e)
    assert e.preemptions_total >= 2 and peak >= 0.95
    assert all(s.state == "finished" and s.generated == 200 for s in seqs)
    assert e.free_blocks == e.total_blocks and not e.running and not e.waiting
    assert e.prompt_tokens_total == 3 * 1800


def test_chunked_prefill_mixes_decode_with_prompt_chunks() -> None:
    cfg = SimConfig(kv_blocks=1000, block_size=16, chunked_prefill=True, max_num_batched_tokens=256)
    e = Engine(cfg)
    chat = Sequence(prompt_tokens=100, max_tokens=50)
    e.add(chat, 0.0)
    out = e.step(0.0)
    assert out.emitted == {chat: 1}  # a prompt that fits one chunk emits its first token
    doc = Sequence(prompt_tokens=1000, max_tokens=5)
    e.add(doc, out.duration)
    out = e.step(out.duration)
    # The chat sequence keeps decoding while the document's first chunk (255 tokens) runs.
    assert out.emitted == {chat: 2} and doc.prefill_left == 1000 - 255
    assert out.duration == pytest.approx(
        (cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * 0.255) / 1000 + e.decode_ms(1, chat.kv_tokens(-1), 0) / 1000)
    drive(e)
    assert chat.generated == 50 and doc.generated == 5 and e.preemptions_total == 0
    assert e.free_blocks == e.total_blocks


def test_chunked_prefill_without_room_to_grow_preempts_like_whole_prefill() -> None:
    # The same overload as test_engine_runs_out_of_kv_and_preempts, scheduled the V1 way.
    e = Engine(SimConfig(kv_blocks=64, block_size=16, chunked_prefill=True))
    seqs = [Sequence(prompt_tokens=200, max_tokens=200, natural_stop=True) for _ in range(8)]
    for s in seqs:
        e.add(s, 0.0)
    drive(e)
    assert e.preemptions_total > 0
    assert all(s.state == "finished" and s.generated == 200 and s.finish_reason == "stop" for s in seqs)
    assert e.free_blocks == e.total_blocks
