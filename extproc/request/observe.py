"""Latency and completion lengths, observed where a stream settles.

At settle a stream knows when it arrived, when it was admitted (its slot granted),
when the first response byte came (``first_byte_s``, from response headers or the
first body chunk) and how many tokens it produced. From those:

* histograms per backend and tier: time to first token from admission and from
  arrival (tokenizing and queue wait included), inter-token latency (the stream's
  time after its first token divided by its other output tokens: no per-chunk work)
  and the end-to-end duration;
* a sample for the backend's adaptive concurrency limit: the TTFT from admission and
  the ITL, each divided by its tier's SLO, the worse of the two. Queue wait is left
  out on purpose: it is what a lower limit causes, so counting it would make the
  limit chase its own tail down to the floor;
* the completion length (per choice) for the learned estimator.

``completion_tokens`` decides what a request reserves per completion: the learned
estimate for a backend with ``kv_reservation: learned`` (KV) or
``tpm_precharge: learned`` (TPM), else ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.policy.reasons import Ending
from extproc.policy.schema import Tier

if TYPE_CHECKING:
    from extproc.openai_api.usage import Usage
    from extproc.request.ticket import Ticket
    from extproc.runtime.runtime import Runtime


@dataclass(frozen=True)
class Reservation:
    kv_completion: int  # per choice, for the KV footprint
    tpm_completion: int  # per choice, for the TPM pre-charge
    source: str  # where the learned number came from (tenant, tier, max_tokens)


def completion_tokens(rt: Runtime, ticket: Ticket, tenant: str, tier: str) -> Reservation:
    spec = ticket.backend
    cap = ticket.completion
    if spec.kv_reservation != "learned" and spec.tpm_precharge != "learned":
        return Reservation(cap, cap, "max_tokens")
    est = rt.completions.estimate(tenant, tier, ticket.model.name, cap, spec.learned_quantile)
    return Reservation(est.tokens if spec.kv_reservation == "learned" else cap,
                       est.tokens if spec.tpm_precharge == "learned" else cap, est.source)


def record_settle(rt: Runtime, ticket: Ticket, tenant: str, tier: Tier, *, how: Ending, status: int,
                  arrived: float, first_byte: float | None, now: float, usage: Usage | None, n: int) -> None:
    """Observe one settled, forwarded request (after its slot went back)."""
    if not ticket.admitted_at or first_byte is None or not 0 < status < 400:
        return
    m = rt.metrics
    ttft = max(0.0, first_byte - ticket.admitted_at)
    rt.ttft_counts.observe(ticket.backend.name, tier.name, ttft)
    done = how == Ending.END_OF_STREAM
    out = usage.completion_tokens // max(1, n) if usage is not None else None
    itl = max(0.0, now - first_byte) / (out - 1) if done and out is not None and out > 1 else None
    m.latency(ticket.backend.name, tier.name, ttft, max(0.0, first_byte - arrived),
              duration=max(0.0, now - arrived) if done else None, itl=itl)
    if done and out is not None and n > 0:
        rt.completions.observe(tenant, tier.name, ticket.model.name, out)
        learned = rt.completions.learned("tier", tier.name, ticket.model.name)
        if learned is not None:
            m.completion_estimated(tier.name, ticket.model.name, learned)
    ctl = ticket.backend_state.adaptive_limit
    if ctl is None:
        return
    ratios = []
    if tier.ttft_p99_ms:
        ratios.append(ttft * 1000.0 / tier.ttft_p99_ms)
    if tier.itl_p99_ms and itl is not None:
        ratios.append(itl * 1000.0 / tier.itl_p99_ms)
    if ratios:
        # +1: this request's own slot, already released, was part of the load it saw.
        ctl.observe(tier.name, max(ratios), ticket.admitted_at, ticket.backend_state.pool.in_use().total + 1, now)
