"""How long completions really are: a decayed high quantile per (tenant, model).

Reserving prompt + ``max_tokens`` of KV for every request is the worst case; most
completions stop far earlier. This estimator learns, per (tenant, model), a high
quantile of recent actual completion lengths (tokens per choice), falls back to the
same per (tier, model) while a tenant has too few samples, and to the request's
``max_tokens`` while neither has. An estimate is never above ``max_tokens``.

Each key keeps a small histogram over log-spaced buckets (each bucket's upper bound
1.1x the previous, so the estimate overstates by at most 10 %: on the safe side for
a KV reservation). Old samples decay: each new sample weighs ``2 ** (1 / half_life)``
times the previous one, so after ``half_life`` samples a sample counts half. The
weights grow instead of the counts shrinking, so a sample costs O(1); the counts are
renormalised when the weight gets large. Memory is bounded: at most ``max_keys``
keys, the least recently updated dropped first, and at most ~150 buckets per key
(sparse: only the lengths seen).

A completion cut off by its ``max_tokens`` would have run longer: it is recorded at
its length anyway (only the request's own cap is known), which the per-request cap
makes harmless for requests with that cap and the watermark covers for others.

Pure and time-free: decay counts samples, not seconds. ``to_dict``/``from_dict``
carry the state across processes or policy reloads; ``snapshot`` reports it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["CompletionEstimator", "Estimate", "LengthHistogram", "bucket_of", "upper_bound"]

RATIO = 1.1
MAX_BUCKET = 150  # upper bound 1.1**150 ~ 1.6 M tokens
_RENORMALISE_AT = 1e100


def upper_bound(i: int) -> int:
    """The largest length bucket ``i`` holds (bucket 0 holds 0 and 1)."""
    return max(1, math.ceil(RATIO ** i - 1e-9))


def bucket_of(tokens: int) -> int:
    if tokens <= 1:
        return 0
    i = max(0, min(MAX_BUCKET, math.ceil(math.log(tokens) / math.log(RATIO)) - 1))
    while i < MAX_BUCKET and upper_bound(i) < tokens:
        i += 1
    while i > 0 and upper_bound(i - 1) >= tokens:
        i -= 1
    return i


class LengthHistogram:
    """Decayed counts of lengths over log buckets."""

    __slots__ = ("counts", "weight", "samples", "growth")

    def __init__(self, half_life: float) -> None:
        self.counts: dict[int, float] = {}
        self.weight = 1.0
        self.samples = 0
        self.growth = 2.0 ** (1.0 / half_life)

    def add(self, tokens: int) -> None:
        i = bucket_of(max(0, tokens))
        self.counts[i] = self.counts.get(i, 0.0) + self.weight
        self.samples += 1
        self.weight *= self.growth
        if self.weight > _RENORMALISE_AT:
            w = self.weight
            self.counts = {k: c / w for k, c in self.counts.items() if c / w > 1e-12}
            self.weight = 1.0

    def quantile(self, q: float) -> int:
        total = sum(self.counts.values())
        if total <= 0:
            return 0
        need = q * total
        acc = 0.0
        for i in sorted(self.counts):
            acc += self.counts[i]
            if acc >= need * (1 - 1e-12):
                return upper_bound(i)
        return upper_bound(max(self.counts))

    def to_dict(self) -> dict[str, Any]:
        w = self.weight
        return {"samples": self.samples, "counts": {str(k): c / w for k, c in sorted(self.counts.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], half_life: float) -> LengthHistogram:
        h = cls(half_life)
        h.samples = int(d.get("samples", 0))
        h.counts = {min(MAX_BUCKET, max(0, int(k))): float(c) for k, c in d.get("counts", {}).items()
                    if float(c) > 0}
        return h


@dataclass(frozen=True)
class Estimate:
    tokens: int  # per choice, never above max_tokens
    source: str  # "tenant", "tier" or "max_tokens"
    samples: int = 0


Key = tuple[str, str, str]  # ("tenant" | "tier", name, model)


class CompletionEstimator:
    def __init__(self, quantile: float = 0.95, half_life: float = 200.0, min_samples: int = 20,
                 max_keys: int = 4096) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if not half_life > 0 or min_samples < 1 or max_keys < 2:
            raise ValueError("need half_life > 0, min_samples >= 1, max_keys >= 2")
        self.quantile, self.half_life, self.min_samples, self.max_keys = quantile, half_life, min_samples, max_keys
        self._h: OrderedDict[Key, LengthHistogram] = OrderedDict()

    def __len__(self) -> int:
        return len(self._h)

    def observe(self, tenant: str, tier: str, model: str, completion_tokens: int) -> None:
        """One finished completion's length in tokens per choice."""
        if completion_tokens < 0:
            return
        for key in (("tenant", tenant, model), ("tier", tier, model)):
            h = self._h.get(key)
            if h is None:
                h = self._h[key] = LengthHistogram(self.half_life)
                while len(self._h) > self.max_keys:
                    self._h.popitem(last=False)
            else:
                self._h.move_to_end(key)
            h.add(completion_tokens)

    def estimate(self, tenant: str, tier: str, model: str, max_tokens: int,
                 quantile: float | None = None) -> Estimate:
        """The learned length for a request capped at ``max_tokens`` (``quantile``
        overrides the estimator's own)."""
        q = self.quantile if quantile is None else quantile
        if max_tokens <= 1:
            return Estimate(max_tokens, "max_tokens")  # nothing to learn (embeddings: 0)
        for kind, name in (("tenant", tenant), ("tier", tier)):
            h = self._h.get((kind, name, model))
            if h is not None and h.samples >= self.min_samples:
                return Estimate(max(1, min(max_tokens, h.quantile(q))), kind, h.samples)
        return Estimate(max_tokens, "max_tokens")

    def learned(self, kind: str, name: str, model: str) -> int | None:
        """The learned quantile of one key ("tenant" or "tier"), None until it is trusted."""
        h = self._h.get((kind, name, model))
        if h is None or h.samples < self.min_samples:
            return None
        return h.quantile(self.quantile)

    # -- persistence and reports -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "quantile": self.quantile, "half_life": self.half_life,
                "min_samples": self.min_samples,
                "keys": [{"kind": k[0], "name": k[1], "model": k[2], **h.to_dict()} for k, h in self._h.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_keys: int = 4096) -> CompletionEstimator:
        est = cls(quantile=float(d.get("quantile", 0.95)), half_life=float(d.get("half_life", 200.0)),
                  min_samples=int(d.get("min_samples", 20)), max_keys=max_keys)
        for item in d.get("keys", [])[-max_keys:]:
            key = (str(item["kind"]), str(item["name"]), str(item["model"]))
            est._h[key] = LengthHistogram.from_dict(item, est.half_life)
        return est

    def snapshot(self, limit: int = 50) -> dict[str, Any]:
        """The most recently updated keys with their sample counts and learned quantile."""
        out: dict[str, Any] = {"keys": len(self._h), "quantile": self.quantile, "estimates": []}
        for (kind, name, model), h in list(reversed(self._h.items()))[:limit]:
            out["estimates"].append({"kind": kind, "name": name, "model": model, "samples": h.samples,
                                     "tokens": h.quantile(self.quantile),
                                     "trusted": h.samples >= self.min_samples})
        return out
