"""Chunked prefill, vLLM V1's default: one engine step that mixes every running sequence's
next token with prompt chunks (engine.py describes the model). A function of the engine,
kept apart so engine.py stays one concern per screen."""

from __future__ import annotations

from typing import Any

from .sequence import Sequence, StepOutcome
from .step_cost import prefill_step_s

# The engine calls this with itself; typed loosely so that this module need not import
# engine.py, which imports it (imports run one way).
Engine = Any

__all__ = ["step_chunked"]


def step_chunked(self: Engine, now: float, out: StepOutcome) -> None:
    """One step of vLLM V1's scheduler (see engine.py's docstring): running sequences first,
    then waiting ones while their first chunk's blocks fit, within one token budget."""
    budget = self.cfg.batched_tokens_budget
    prefill = 0
    decode: list[tuple[Sequence, int]] = []
    completed: list[Sequence] = []  # their prompt's last chunk ran in this step
    for seq in list(self.running):
        if seq.state != "running" or budget <= 0:
            continue  # preempted earlier in this step, or no budget left
        if seq.prefill_left > 0:
            chunk = min(seq.prefill_left, budget)
            last = chunk == seq.prefill_left
            done = seq.kv_tokens() - seq.prefill_left + chunk
            if not self._reserve(seq, done + (seq.n if last and seq.wants_tokens else 0), now, out):
                continue
            seq.prefill_left -= chunk
            budget -= chunk
            prefill += chunk
            if last:
                completed.append(seq)
                self._register(seq)
        elif not seq.wants_tokens and now >= seq.ready_at:
            self._finish(seq, "stop", out)
        elif (k := self._due(seq, now)) > 0 and self._grow(seq, k, now, out):
            decode.append((seq, k))
            budget -= 1
    if not out.preempted and not self.paused(now):
        while (
            budget > 0
            and len(self.running) < self.cfg.max_num_seqs
            and (head := self._fitting_head(out)) is not None
        ):
            seq, _, hit = head
            cached = len(hit) * self.cfg.block_size
            total = seq.kv_tokens() - cached  # to compute: a hit is never the whole prompt
            chunk = min(total, budget)
            last = chunk == total
            first = self._blocks_for(cached + chunk + (seq.n if last and seq.wants_tokens else 0))
            first -= self.prefix.shared_among(hit) if self.prefix is not None else 0
            if self.free_blocks - first < self.watermark_blocks:
                break
            self._start(seq, first, hit)
            seq.prefill_left = total - chunk
            budget -= chunk
            prefill += chunk
            if last:
                completed.append(seq)
                self._register(seq)
    decode = [(s, k) for s, k in decode if s.state == "running"]
    if not prefill and not decode:
        out.wake_at = self._next_wake(now) if not out.finished and not out.failed else now
        return
    out.kind = "prefill" if prefill else "decode"
    if prefill:
        out.duration += prefill_step_s(self.cfg, prefill)
    if decode:
        out.duration += (
            self.decode_ms(len(decode), sum(s.kv_tokens() for s, _ in decode), now) / 1000.0
        )
    end = now + out.duration
    for seq, k in decode:
        self._emit(seq, k, end, out)
    for seq in completed:
        if seq.state != "running" or now < seq.ready_at:
            continue  # preempted later in the step, or a programmed delay
        if not seq.wants_tokens:
            self._finish(seq, "stop", out)
        else:
            self._emit(seq, 1, end, out)
