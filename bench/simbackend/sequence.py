"""What the engine schedules and what one of its steps produced (``engine.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Sequence:
    """One request in the engine (its n choices decode together, as vLLM's forked seqs)."""

    prompt_tokens: int
    max_tokens: int  # tokens per choice to generate; 0 = prefill only (embeddings)
    n: int = 1
    delay: float = 0.0  # model seconds before the first token may appear
    tps: float | None = None  # own pace (tokens/s) instead of the batch's step rate
    # Whether producing max_tokens is the model stopping by itself ("stop") or the
    # client's limit cutting it off ("length").
    natural_stop: bool = False
    # Who asked, for the engine's own per-request record (work.py): the HTTP request's
    # x-request-id and the gateway's x-sluice-tenant ("" when absent).
    request_id: str = ""
    tenant: str = ""
    # vLLM's request field ``priority`` (lower runs first under --scheduling-policy priority).
    priority: int = 0
    # Set by the engine:
    arrival: int = 0  # arrival order, the tie-break after priority (vLLM's arrival_time)
    state: str = "new"  # waiting | running | finished | failed | aborted
    ready_at: float = 0.0
    generated: int = 0  # tokens per choice so far
    blocks: int = 0
    admit_order: int = 0
    first_token_at: float | None = None
    prefilled_once: bool = False
    prefill_left: int = 0  # chunked prefill: KV tokens still to compute in this residency
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: tuple[int, str] | None = None
    # Prefix caching: chained hashes of the prompt's full blocks (set by the request
    # handler), the shared cached blocks held, and the prompt tokens they spared.
    block_hashes: tuple[int, ...] = ()
    cached: list[int] = field(default_factory=list)
    cache_hit_tokens: int = 0

    def kv_tokens(self, extra: int = 0) -> int:
        return self.prompt_tokens + self.n * (self.generated + extra)

    @property
    def wants_tokens(self) -> bool:
        return self.generated < self.max_tokens


@dataclass
class StepOutcome:
    duration: float = 0.0  # model seconds the step occupies the GPU; 0 = nothing ran
    wake_at: float | None = None  # when idle: the next time something becomes due
    kind: str = "idle"  # prefill | decode | idle
    emitted: dict[Sequence, int] = field(default_factory=dict)  # seq -> generated after step
    finished: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
