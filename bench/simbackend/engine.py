"""The KV-cache and continuous-batching model: a vLLM-V0-like scheduler without I/O.

Time is passed in (model seconds) and every step returns how long it would take on the
GPU, so tests drive it with a fake clock and the async runner sleeps the durations.

What is modelled, because the gateway's behaviour depends on it:
- KV blocks are a hard budget: a sequence holds ceil(kv_tokens / block_size) blocks and
  takes a new one whenever it grows past a block boundary.
- Admission is FCFS with a watermark; a prefill step stalls decoding (no chunked prefill).
  With ``chunked_prefill`` (vLLM V1's default) a step instead mixes every running
  sequence's next token with prompt chunks of up to ``max_num_batched_tokens`` tokens:
  running sequences are scheduled first (a partly prefilled one continues its prompt),
  then waiting ones are admitted while their *first chunk's* blocks fit, and a sequence
  that cannot get a block preempts the newest running one; no admission follows a
  preemption in the same step. Blocks are taken chunk by chunk, so several long prompts
  can be admitted together and then outgrow the cache: the recompute thrash vLLM shows
  under a burst of long prompts. Such a step costs its prefill part (as below, for the
  chunk tokens) plus its decode part.
- Latency depends on load the way it does on a GPU (``step_cost.py``, constants in
  ``SimConfig``). ``slow_down(factor, until)`` multiplies decode steps (not prefill,
  not KV) until ``until``: a thermally throttled or shared GPU.
- With ``prefix_caching`` (vLLM's automatic prefix caching, ``prefix_cache.py``) a
  sequence whose leading full prompt blocks are cached references them instead of
  taking new blocks, and its prefill skips those tokens; blocks are registered once the
  prompt's prefill completes, and cached free blocks are evicted LRU when room is needed.
- Running out of blocks either preempts the newest sequence (recompute: it returns to the
  front of the queue and redoes its prefill) or, in "oom" mode, kills every running
  request and pauses admission, the way a crashing server would.
- ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy priority``): the waiting
  queue is ordered by the request's ``priority`` (lower first), then arrival
  (``waitqueue.py``); the sequence preempted for room is the running one of the lowest
  priority, latest arrival (not the newest); and, as vLLM V0's
  ``_schedule_priority_preemption`` does, a waiting head that does not fit preempts
  running sequences of lower priority, lowest first, until it does (the whole-prompt
  path; vLLM V1's chunked scheduler preempts only for a running sequence's growth).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

from .chunked import step_chunked
from .config import SimConfig
from .prefix_cache import PrefixCache
from .sequence import Sequence, StepOutcome
from .step_cost import decode_step_ms, prefill_step_s
from .waitqueue import WaitQueue, order_key
from .work import WorkLog

__all__ = ["OOM_MESSAGE", "Engine", "Sequence", "StepOutcome"]

OOM_MESSAGE = "CUDA out of memory: the simulated KV cache is exhausted"


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.mode = cfg.mode
        self.total_blocks = cfg.kv_blocks
        self.free_blocks = cfg.kv_blocks
        self.watermark_blocks = int(cfg.watermark * cfg.kv_blocks)
        self.waiting = WaitQueue(cfg.scheduling_policy)
        self._arrivals = itertools.count(1)
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.paused_until = -math.inf
        self._admitted = 0
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.oom_failures_total = 0
        self.finished_total: Counter[str] = Counter()
        self.slow_factor = 1.0
        self.slow_until = -math.inf
        # Highest occupancy seen; a scrape every second misses short peaks.
        self.peak_used_blocks = 0
        self.prefix = PrefixCache(cfg.block_size) if cfg.prefix_caching else None
        self.work = WorkLog(cfg.work_log_limit)  # what each request cost (work.py)

    # ---- what metrics and tests read -------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks

    def paused(self, now: float) -> bool:
        return now < self.paused_until

    def slow_down(self, factor: float, until: float) -> None:
        """Decode steps take ``factor`` times as long until model time ``until``."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        self.slow_factor, self.slow_until = factor, until

    def decode_ms(self, batch: int, kv_tokens: int, now: float) -> float:
        """How long one decode step of ``batch`` sequences attending to ``kv_tokens`` takes."""
        return decode_step_ms(self.cfg, batch, kv_tokens) * (self.slow_factor if now < self.slow_until else 1.0)

    # ---- requests in and out --------------------------------------------------------
    def add(self, seq: Sequence, now: float) -> None:
        seq.state = "waiting"
        seq.ready_at = now + seq.delay
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> int:
        """The client went away: forget the sequence and free its blocks at once. Returns the
        blocks freed (-1: it had already ended)."""
        freed = 0
        if seq.state == "waiting":
            self.waiting.remove(seq)
        elif seq.state == "running":
            self.running.remove(seq)
            before = self.free_blocks
            self._free(seq)
            freed = self.free_blocks - before
        else:
            return -1
        seq.state = "aborted"
        self.finished_total["abort"] += 1
        self.work.finished(seq, "abort")
        return freed

    # ---- one scheduler iteration ----------------------------------------------------
    def step(self, now: float) -> StepOutcome:
        out = StepOutcome()
        if self.cfg.chunked_prefill:
            step_chunked(self, now, out)
            return out
        admitted = [] if self.paused(now) else self._admit(out)
        if admitted:
            self._prefill(now, admitted, out)
        else:
            self._decode(now, out)
        return out

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _admission_blocks(self, seq: Sequence, hit: list[int]) -> int:
        # Room for the prompt (plus what a preempted sequence already produced, which
        # recompute prefills again) and the token this prefill will emit, less the
        # cached blocks other sequences already hold (shared, they cost nothing).
        shared = self.prefix.shared_among(hit) if self.prefix is not None else 0
        return self._blocks_for(seq.kv_tokens(1 if seq.wants_tokens else 0)) - shared

    def _hit(self, seq: Sequence) -> list[int]:
        if self.prefix is None or not seq.block_hashes:
            return []
        return self.prefix.lookup(seq.block_hashes, seq.prompt_tokens)

    def _alloc(self, blocks: int) -> None:
        if self.prefix is not None:
            self.prefix.evict_for(blocks, self.free_blocks)
        self.free_blocks -= blocks

    def _admit(self, out: StepOutcome) -> list[Sequence]:
        if self.waiting.by_priority:
            self._priority_preempt(out)
        admitted: list[Sequence] = []
        budget = self.cfg.batched_tokens_budget
        batched = 0
        while len(self.running) < self.cfg.max_num_seqs and (head := self._fitting_head(out)) is not None:
            seq, need, hit = head
            prefill = seq.kv_tokens() - len(hit) * self.cfg.block_size
            if admitted and batched + prefill > budget:
                break
            if self.free_blocks - need < self.watermark_blocks:
                break
            self._start(seq, need, hit)
            admitted.append(seq)
            batched += prefill
        return admitted

    def _priority_preempt(self, out: StepOutcome) -> None:
        """vLLM V0's priority preemption: the waiting head preempts running sequences of lower
        priority (lowest, latest first) until it fits (blocks and a batch place)."""
        if not self.waiting:
            return
        head = self.waiting.head()
        need = self._admission_blocks(head, self._hit(head))
        if need > self.total_blocks - self.watermark_blocks:
            return  # it never fits; _fitting_head fails it
        while self.running:
            if (
                self.free_blocks - need >= self.watermark_blocks
                and len(self.running) < self.cfg.max_num_seqs
            ):
                return
            victim = max(self.running, key=order_key)
            if order_key(victim) <= order_key(head):
                return
            self._preempt(victim, out)

    def _victim(self) -> Sequence:
        """Whom to preempt for room: the newest (fcfs), or the lowest priority, latest arrival."""
        return max(self.running, key=order_key) if self.waiting.by_priority else self.running[-1]

    def _fitting_head(self, out: StepOutcome) -> tuple[Sequence, int, list[int]] | None:
        """The queue's head, the free blocks it needs to start and its cached leading blocks;
        heads that would never fit, even alone, are failed on the way (waiting would
        block the queue forever)."""
        while self.waiting:
            seq = self.waiting.head()
            hit = self._hit(seq)
            need = self._admission_blocks(seq, hit)
            if need <= self.total_blocks - self.watermark_blocks:
                return seq, need, hit
            self.waiting.popleft()
            self._too_big(seq, need, out)
        return None

    def _start(self, seq: Sequence, blocks: int, hit: list[int]) -> None:
        """Move the queue's head to running, taking ``blocks`` free blocks: the cached
        ones of ``hit`` nobody held, and new private ones for the rest."""
        self.waiting.popleft()
        if self.prefix is not None:
            from_free = self.prefix.acquire(hit)
            self.free_blocks -= from_free
            blocks -= from_free
            self.prefix.count_query(seq.prompt_tokens, len(hit))
        seq.cached = list(hit)
        seq.cache_hit_tokens = len(hit) * self.cfg.block_size
        self._alloc(blocks)
        seq.blocks = blocks
        seq.state = "running"
        self._admitted += 1
        seq.admit_order = self._admitted
        self.running.append(seq)
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)
        if not seq.prefilled_once:
            seq.prefilled_once = True
            self.prompt_tokens_total += seq.prompt_tokens

    def _prefill(self, now: float, admitted: list[Sequence], out: StepOutcome) -> None:
        tokens = sum(s.kv_tokens() - s.cache_hit_tokens for s in admitted)
        for seq in admitted:
            self._register(seq)
        out.kind = "prefill"
        out.duration = prefill_step_s(self.cfg, tokens)
        end = now + out.duration
        for seq in admitted:
            if now < seq.ready_at:
                continue  # a programmed delay: it holds its blocks but shows nothing yet
            if not seq.wants_tokens:
                self._finish(seq, "stop", out)
                continue
            # Prefill produces the next token; its block was reserved at admission.
            self._emit(seq, 1, end, out)

    def _decode(self, now: float, out: StepOutcome) -> None:
        for seq in [s for s in self.running if not s.wants_tokens and now >= s.ready_at]:
            self._finish(seq, "stop", out)
        batch = [(s, k) for s in self.running if (k := self._due(s, now)) > 0]
        if not batch:
            out.wake_at = self._next_wake(now)
            return
        out.kind = "decode"
        out.duration = self.decode_ms(len(batch), sum(s.kv_tokens() for s, _ in batch), now) / 1000.0
        end = now + out.duration
        for seq, k in batch:
            if seq.state != "running":
                continue  # preempted or failed earlier in this step
            if not self._grow(seq, k, now, out):
                if self.mode == "oom" and not self.running:
                    break
                continue
            self._emit(seq, k, end, out)

    def _due(self, seq: Sequence, now: float) -> int:
        if not seq.wants_tokens or now < seq.ready_at:
            return 0
        if seq.tps is None or seq.first_token_at is None:
            return 1
        # A tiny epsilon so a wake-up computed from the same formula never lands a hair
        # before the token is due (which would spin).
        due = 1 + math.floor((now - seq.first_token_at) * seq.tps + 1e-9)
        return max(0, min(seq.max_tokens, due) - seq.generated)

    def _next_wake(self, now: float) -> float | None:
        times: list[float] = []
        for seq in self.running:
            if now < seq.ready_at:
                times.append(seq.ready_at)
            elif seq.tps is not None and seq.first_token_at is not None and seq.wants_tokens:
                times.append(seq.first_token_at + seq.generated / seq.tps)
        if self.waiting and self.paused(now):
            times.append(self.paused_until)
        return min(times) if times else None

    def _grow(self, seq: Sequence, k: int, now: float, out: StepOutcome) -> bool:
        """Give ``seq`` the blocks for k more tokens, freeing others' if needed."""
        return self._reserve(seq, seq.kv_tokens(k), now, out)

    def _reserve(self, seq: Sequence, tokens: int, now: float, out: StepOutcome) -> bool:
        """Give ``seq`` blocks for ``tokens`` KV tokens in all, preempting the newest if needed."""
        need = self._blocks_for(tokens) - seq.blocks - len(seq.cached)
        while need > self.free_blocks:
            if self.mode == "oom":
                self._oom(now, out)
                return False
            victim = self._victim()
            if victim is seq and len(self.running) == 1:
                # Alone and still out of room: preempting itself would loop forever.
                self._finish(seq, "length", out)
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        self._alloc(need)
        seq.blocks += need
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)
        return True

    def _emit(self, seq: Sequence, k: int, end: float, out: StepOutcome) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = end
        seq.generated += k
        self.generation_tokens_total += k * seq.n
        out.emitted[seq] = seq.generated
        if not seq.wants_tokens:
            self._finish(seq, "stop" if seq.natural_stop else "length", out)

    # ---- endings ----------------------------------------------------------------------
    def _register(self, seq: Sequence) -> None:
        """The prompt's KV is computed: its full blocks become shareable cached blocks."""
        if self.prefix is None:
            return
        for h in seq.block_hashes[len(seq.cached):]:
            if seq.blocks > 0 and self.prefix.register(h):
                seq.cached.append(h)
                seq.blocks -= 1

    def _free(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        if self.prefix is not None and seq.cached:
            self.free_blocks += self.prefix.release(seq.cached)
        seq.cached = []

    def _finish(self, seq: Sequence, reason: str, out: StepOutcome) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.state = "finished"
        seq.finish_reason = reason
        self.finished_total[reason] += 1
        self.work.finished(seq, reason)
        out.finished.append(seq)

    def _fail(self, seq: Sequence, status: int, message: str, out: StepOutcome) -> None:
        self._free(seq)
        seq.state = "failed"
        seq.error = (status, message)
        self.finished_total["error"] += 1
        self.work.finished(seq, "error")
        out.emitted.pop(seq, None)
        out.failed.append(seq)

    def _too_big(self, seq: Sequence, need: int, out: StepOutcome) -> None:
        if seq.generated:
            self._finish(seq, "length", out)
            return
        usable = self.total_blocks - self.watermark_blocks
        msg = (
            f"request needs {need} KV blocks of {self.cfg.block_size} tokens but the cache "
            f"has only {usable}"
        )
        self._fail(seq, 400, msg, out)

    def _preempt(self, victim: Sequence, out: StepOutcome) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.state = "waiting"
        victim.num_preemptions += 1
        self.waiting.prepend(victim)
        self.preemptions_total += 1
        out.emitted.pop(victim, None)
        out.preempted.append(victim)

    def _oom(self, now: float, out: StepOutcome) -> None:
        victims = list(self.running)
        self.running.clear()
        for seq in victims:
            self._fail(seq, 500, OOM_MESSAGE, out)
        self.oom_failures_total += len(victims)
        self.paused_until = now + self.cfg.oom_pause_s
