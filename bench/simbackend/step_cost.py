"""How long a scheduler step of the simulated engine takes on the GPU (model time).

Latency depends on load the way it does on a GPU (constants in ``SimConfig``):

    prefill step = ttft_ms + prefill_ms_per_1k_tokens x (prompt tokens in the step) / 1000
    decode step  = (1000 / tokens_per_s + decode_ms_per_seq x batch size
                    + decode_ms_per_1k_kv_tokens x (KV tokens the batch attends to) / 1000)
                   x slowdown factor (1 unless ``Engine.slow_down`` is in effect)

Defaults (an 8B model on one 24 GB GPU, roughly): 20 ms + 25 ms per 1k prompt tokens,
so a 32k-token prompt stalls every running stream for ~0.8 s; 10 ms + 0.25 ms per
sequence + 0.3 ms per 1k KV tokens, so one sequence alone decodes at ~100 tok/s, a
batch of 64 with short contexts at ~38 tok/s each, and a full 32k-token cache adds
~10 ms per step (reading the KV cache is the memory-bound part of decoding).
"""

from __future__ import annotations

from .config import SimConfig


def prefill_step_s(cfg: SimConfig, tokens: int) -> float:
    """Seconds of a prefill step computing ``tokens`` prompt tokens (cached ones excluded)."""
    return (cfg.ttft_ms + cfg.prefill_ms_per_1k_tokens * tokens / 1000.0) / 1000.0


def decode_step_ms(cfg: SimConfig, batch: int, kv_tokens: int) -> float:
    """Milliseconds of one decode step of ``batch`` sequences attending to ``kv_tokens``,
    before any slowdown."""
    return (1000.0 / cfg.tokens_per_s + cfg.decode_ms_per_seq * batch
            + cfg.decode_ms_per_1k_kv_tokens * kv_tokens / 1000.0)
