"""What the engine did for each request, kept by the engine itself: the ground truth a
gateway's bill is checked against.

vLLM counts the same things in total (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``) and
per request in histograms (``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``). Here every finished sequence also leaves a record
(``Work``) under the id its HTTP request carried (``x-request-id``, which Envoy sets on
every request it forwards), with the tenant the gateway named (``x-sluice-tenant``), so a
test can hold one request's charge against what the engine processed for it.

- ``prompt_tokens``: the prompt, once its prefill began (a preempted sequence's recompute
  is not counted twice, as in vLLM); 0 if it never left the queue.
- ``generation_tokens``: tokens produced, for every choice (n).
- ``finished_reason``: ``stop``, ``length``, ``abort`` (the client went away) or
  ``error`` (failed, e.g. out of memory), vLLM's names.

Records are kept newest last, at most ``limit`` of them; totals per tenant are kept for
the life of the process. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any

from .sequence import Sequence

FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class Work:
    seq: int  # the record's number, from 1: a reader asks for those after the last it saw
    request_id: str
    tenant: str
    prompt_tokens: int
    generation_tokens: int
    finished_reason: str

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generation_tokens


class WorkLog:
    def __init__(self, limit: int = 10_000) -> None:
        self.records: deque[Work] = deque(maxlen=limit)
        self.count = 0
        self.by_tenant: dict[str, Counter[str]] = {}

    def finished(self, seq: Sequence, reason: str) -> Work:
        """Note how ``seq`` ended (once: the engine calls this from each exit)."""
        self.count += 1
        w = Work(
            self.count,
            seq.request_id,
            seq.tenant,
            seq.prompt_tokens if seq.prefilled_once else 0,
            seq.generated * seq.n,
            reason,
        )
        self.records.append(w)
        totals = self.by_tenant.setdefault(seq.tenant, Counter())
        totals["prompt_tokens"] += w.prompt_tokens
        totals["generation_tokens"] += w.generation_tokens
        totals[f"finished_{reason}"] += 1
        return w

    def since(self, after: int = 0) -> list[Work]:
        """The records numbered above ``after`` that are still kept, oldest first."""
        if after >= self.count:
            return []
        skip = len(self.records) - (self.count - after)
        return list(self.records)[max(skip, 0) :]

    def report(self, after: int = 0) -> dict[str, Any]:
        """What GET /admin/work returns."""
        return {
            "count": self.count,
            "requests": [asdict(w) for w in self.since(after)],
            "by_tenant": {t: dict(c) for t, c in self.by_tenant.items()},
        }
