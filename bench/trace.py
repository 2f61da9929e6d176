"""The benchmark's traffic: Azure's LLM conversation trace, time-compressed, split into tenants.

The trace (``../shared/data/azure-llm-trace-2023/``, CC-BY 4.0, Patel et al., "Splitwise",
ISCA 2024) holds an hour of real arrivals with prompt and generated token counts. A
schedule replays consecutive stretches of it, one per phase, with the gaps between
arrivals scaled so each phase offers ``load`` times the backend's measured capacity: the
burstiness of the real arrivals is kept, only the mean rate changes. Chat arrivals are
dealt to the premium and free tenants; an offline batch tenant adds long documents
(~16k-token prompts, on the long-context model) at seeded uniform times. Everything is drawn
from one seeded RNG, so every configuration, and every run, sees the same schedule.

Pure: no I/O except ``load_trace`` reading the CSV.
"""

from __future__ import annotations

import csv
import datetime
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TRACE = Path("shared") / "data" / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"
# Beside the checkout, or beside the directory of worktrees (a git worktree two levels down).
TRACE_PATH = next((p / _TRACE for p in (ROOT.parent, ROOT.parent.parent) if (p / _TRACE).exists()),
                  ROOT.parent / _TRACE)

CHAT_MODEL = "sim-llama-8b"  # context window 8192 in the example policy
LONG_MODEL = "sim-llama-8b-long"  # 32768: where the batch tenant's documents go
CHAT_WINDOW = 8192


@dataclass(frozen=True)
class TraceRow:
    t: float  # seconds since the trace's first arrival
    prompt: int
    gen: int


@dataclass(frozen=True)
class Request:
    id: int
    at: float  # seconds after the schedule starts
    phase: str
    tier: str  # premium | free | batch
    model: str
    prompt_tokens: int
    max_tokens: int  # what the client asks for (the worst case a gateway must assume)
    gen_tokens: int  # what the "model" really produces (x-sim-tokens), capped by max_tokens

    @property
    def completion(self) -> int:
        return min(self.gen_tokens, self.max_tokens)


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    load: float  # offered load as a multiple of the backend's capacity (requests/s)


@dataclass(frozen=True)
class Mix:
    """Who sends what. Shares are of requests; max_tokens are what real clients send."""

    premium_share: float = 0.6  # of chat arrivals; the rest are free tier
    batch_share: float = 0.04  # batch requests per chat request (each ~12x the tokens)
    premium_max_tokens: int = 1024
    free_max_tokens: int = 512
    batch_max_tokens: int = 1024
    batch_prompt_mean: int = 16000
    batch_prompt_sd: int = 1500
    batch_prompt_range: tuple[int, int] = (12000, 20000)


@dataclass
class Schedule:
    requests: list[Request]
    phases: list[Phase]
    capacity_rps: float
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> [start, end)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def in_phase(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.phase == name]


def _parse_time(text: str) -> datetime.datetime:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, one more than Python takes.
    head, _, frac = text.strip().partition(".")
    return datetime.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def load_trace(path: Path | str = TRACE_PATH) -> list[TraceRow]:
    with open(path, newline="") as fh:
        raw = [(_parse_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
               for r in csv.DictReader(fh)]
    if not raw:
        raise ValueError(f"{path}: no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow((t - t0).total_seconds(), p, max(1, g)) for t, p, g in raw]


def mean_rate(rows: Sequence[TraceRow]) -> float:
    span = rows[-1].t - rows[0].t
    return (len(rows) - 1) / span if span > 0 else float(len(rows))


def _segment(rows: Sequence[TraceRow], cursor: int, count: int, base: float
             ) -> tuple[list[float], list[TraceRow]]:
    """``count + 1`` arrival times from ``cursor`` on (continuous across the wrap) and the rows."""
    times: list[float] = []
    picked: list[TraceRow] = []
    shift = 0.0
    for k in range(count + 1):
        i = (cursor + k) % len(rows)
        if k and i == 0:
            shift = times[-1] + 1.0 / base - rows[0].t
        times.append(rows[i].t + shift)
        picked.append(rows[i])
    return times, picked[:count]


def chat_request(rid: int, at: float, phase: str, row: TraceRow, tier: str, mix: Mix) -> Request:
    max_tokens = mix.premium_max_tokens if tier == "premium" else mix.free_max_tokens
    # The example policy's chat model has an 8k window: a longer conversation would be
    # truncated by the client, so every configuration gets the same, valid request.
    prompt = max(1, min(row.prompt, CHAT_WINDOW - max_tokens - 16))
    return Request(rid, at, phase, tier, CHAT_MODEL, prompt, max_tokens, min(row.gen, max_tokens))


def batch_request(rid: int, at: float, phase: str, rng: random.Random, gen: int, mix: Mix) -> Request:
    lo, hi = mix.batch_prompt_range
    prompt = int(min(hi, max(lo, rng.gauss(mix.batch_prompt_mean, mix.batch_prompt_sd))))
    return Request(rid, at, phase, "batch", LONG_MODEL, prompt, mix.batch_max_tokens,
                   min(gen, mix.batch_max_tokens))


def build_schedule(rows: Sequence[TraceRow], phases: Sequence[Phase], capacity_rps: float,
                   mix: Mix = Mix(), seed: int = 7) -> Schedule:
    """Open-loop arrivals for ``phases`` at ``load x capacity_rps`` requests/s each.

    ``capacity_rps`` is in requests of this mix per second (chat and batch together).
    Each phase replays the next stretch of the trace from a seeded starting point:
    exactly the expected number of chat arrivals, their real gaps scaled so the
    stretch spans the phase; batch documents arrive at seeded uniform times.
    """
    if capacity_rps <= 0:
        raise ValueError("capacity_rps must be > 0")
    rng = random.Random(seed)
    base = mean_rate(rows)  # only for the gap across the hour's end
    cursor = rng.randrange(len(rows))
    chat_frac = 1.0 / (1.0 + mix.batch_share)
    out: list[Request] = []
    bounds: dict[str, tuple[float, float]] = {}
    start = 0.0
    for ph in phases:
        if ph.seconds <= 0 or ph.load <= 0:
            raise ValueError(f"phase {ph.name}: seconds and load must be > 0")
        bounds[ph.name] = (start, start + ph.seconds)
        target = ph.load * capacity_rps
        # Exactly the expected number of consecutive trace arrivals, their span stretched
        # onto the phase: the local mean rate becomes the target, the real gaps stay.
        count = max(1, round(target * chat_frac * ph.seconds))
        times, picked = _segment(rows, cursor, count, base)
        span = times[-1] - times[0]
        for t, row in zip(times, picked, strict=False):
            tier = "premium" if rng.random() < mix.premium_share else "free"
            out.append(chat_request(0, start + (t - times[0]) / span * ph.seconds, ph.name, row, tier, mix))
        cursor = (cursor + count) % len(rows)
        # The batch job's documents: the expected count, at seeded uniform times.
        for _ in range(round(target * (1.0 - chat_frac) * ph.seconds)):
            gen = rows[rng.randrange(len(rows))].gen
            out.append(batch_request(0, start + rng.uniform(0, ph.seconds), ph.name, rng, gen, mix))
        start += ph.seconds
    out.sort(key=lambda r: r.at)
    requests = [Request(i, r.at, r.phase, r.tier, r.model, r.prompt_tokens, r.max_tokens, r.gen_tokens)
                for i, r in enumerate(out)]
    return Schedule(requests, list(phases), capacity_rps, bounds)


def sample_mix(rows: Sequence[TraceRow], n: int, mix: Mix = Mix(), seed: int = 11) -> list[Request]:
    """``n`` requests of the schedule's mix without arrival times (for closed-loop runs).

    Every k-th request is a batch document (k from the batch share), so any stretch of
    the sequence has the mix's proportions: a closed loop that only gets through a
    hundred requests measures the mix, not the luck of the draw.
    """
    rng = random.Random(seed)
    every = max(2, round((1.0 + mix.batch_share) / mix.batch_share)) if mix.batch_share > 0 else 0
    out: list[Request] = []
    for i in range(n):
        row = rows[rng.randrange(len(rows))]
        if every and i % every == every // 2:
            out.append(batch_request(i, 0.0, "capacity", rng, row.gen, mix))
        else:
            tier = "premium" if rng.random() < mix.premium_share else "free"
            out.append(chat_request(i, 0.0, "capacity", row, tier, mix))
    return out


def mean_kv_tokens(requests: Sequence[Request]) -> float:
    """Mean KV footprint at the end of a request: prompt plus what it generates."""
    return sum(r.prompt_tokens + r.completion for r in requests) / max(1, len(requests))


def default_phases(quick: bool = False) -> list[Phase]:
    """Steady near capacity, a burst at ~3x, recovery below capacity."""
    if quick:
        return [Phase("steady", 8, 0.9), Phase("burst", 6, 3.0), Phase("recovery", 6, 0.6)]
    return [Phase("steady", 15, 0.9), Phase("burst", 12, 3.0), Phase("recovery", 13, 0.6)]
