"""Everything a stream needs that outlives it: the policy snapshot, the state, metrics.

The policy is swapped whole; a stream pins the snapshot it started with, so a reload
mid-request never changes the rules a request was admitted under, and accounting
(kept in ``state`` and the backends, keyed by name) survives the swap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tiktoken

from extproc import tokens
from extproc.backends import BackendRuntime
from extproc.metrics import Metrics
from extproc.policy.completions import CompletionEstimator
from extproc.policy.gate import LocalState
from extproc.policy.schema import Policy
from extproc.policy.state import TokenState

log = logging.getLogger("sluice.runtime")

# Below this many characters tokenizing costs less than a hop to a thread.
OFFLOAD_CHARS = 16 * 1024
SHORT_TEXT = 24
SHORT_CACHE_ENTRIES = 4096


class Runtime:
    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 tokenize_threads: int = 2) -> None:
        self.clock = clock
        self.metrics = Metrics()
        self.state: TokenState = LocalState()
        self.executor = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="sluice-tokenize")
        self.encodings: dict[str, tiktoken.Encoding] = {}
        self._short_counts: dict[str, dict[str, int]] = {}
        self.policy = policy
        self.etag = ""
        self.backends: dict[str, BackendRuntime] = {}
        self.tenant_in_flight: Counter[str] = Counter()
        self.rejections: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.degradations: defaultdict[str, Counter[str]] = defaultdict(Counter)
        # Learned completion lengths: runtime state, so they survive policy swaps.
        self.completions = CompletionEstimator()
        self._load_encodings(policy)
        self._sync_backends(policy)
        self.metrics.policy_ok.set(1)

    def _load_encodings(self, policy: Policy) -> None:
        for _, model in policy.by_model.values():
            if model.encoding not in self.encodings:
                self.encodings[model.encoding] = tokens.get_encoding(model.encoding)

    def _sync_backends(self, policy: Policy) -> None:
        now = self.clock()
        for spec in policy.backends:
            be = self.backends.get(spec.name)
            if be is None:
                self.backends[spec.name] = BackendRuntime.create(spec, policy, now)
            else:
                be.reconfigure(spec, policy, now)
        # A removed backend keeps its runtime until its in-flight requests settle;
        # they hold references to it, so dropping it from the map is enough.
        for name in [n for n in self.backends if n not in {b.name for b in policy.backends}]:
            del self.backends[name]

    def swap(self, policy: Policy, etag: str = "") -> None:
        self._load_encodings(policy)
        self._sync_backends(policy)
        self.policy = policy
        self.etag = etag
        self.state.forget(set(policy.tenants))
        log.info("policy swapped: %d tenants, %d backends", len(policy.tenants), len(policy.backends))

    # -- per-tenant bookkeeping for status reports ------------------------------
    def track(self, tenant: str, delta: int) -> None:
        self.tenant_in_flight[tenant] += delta

    def count_rejection(self, tenant: str, reason: str) -> None:
        self.rejections[tenant][reason] += 1

    def count_degradation(self, tenant: str, kind: str) -> None:
        self.degradations[tenant][kind] += 1

    # -- tokenizing ------------------------------------------------------------------
    async def count_tokens(self, encoding: str, texts: list[str]) -> int:
        size = sum(len(t) for t in texts)
        if size < OFFLOAD_CHARS:
            return self.count_tokens_now(encoding, texts)
        # tiktoken releases the GIL: a 128 KiB prompt costs ~7-30 ms, which other
        # streams on the event loop must not wait for.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.count_tokens_now, encoding, texts)

    def count_tokens_now(self, encoding: str, texts: list[str]) -> int:
        """For settle paths that cannot await (a stream being torn down)."""
        enc = self.encodings[encoding]
        short = self._short_counts.setdefault(encoding, {})
        total = 0
        for t in texts:
            if len(t) <= SHORT_TEXT:
                # Roles, names and tiny messages repeat on every request.
                n = short.get(t)
                if n is None:
                    n = len(enc.encode_ordinary(t))
                    if len(short) < SHORT_CACHE_ENTRIES:
                        short[t] = n
                total += n
            else:
                total += len(enc.encode_ordinary(t))
        return total

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        st = self.state.snapshot(now)
        st["backends"] = {name: backend_status(be, now) for name, be in self.backends.items()}
        st["policy_etag"] = self.etag
        st["tenants"] = self.tenant_status(now)
        st["completions"] = self.completions.snapshot()
        return st

    def tenant_status(self, now: float) -> dict[str, Any]:
        out = {}
        for name, tenant in self.policy.tenants.items():
            limits = self.policy.limits(tenant)
            tv, _ = self.state.view(name, limits, now)
            out[name] = {"tier": tenant.tier, "in_flight": self.tenant_in_flight.get(name, 0),
                         "tokens_remaining": tv.remaining, "tpm": limits.tpm,
                         "rejections": dict(self.rejections.get(name, {})),
                         "degraded": dict(self.degradations.get(name, {}))}
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def backend_status(be: BackendRuntime, now: float) -> dict[str, Any]:
    sample = be.sample
    use = be.pool.in_use()
    limits = be.pool.effective_limits(be.slot_scale(now))
    snap = be.breaker.snapshot(now)
    routes = {model: _breaker_summary(b.snapshot(now)) for model, b in be.route_breakers.items()}
    return {
        "kv_usage": getattr(sample, "kv_usage", None),
        "waiting": getattr(sample, "waiting", None),
        "running": getattr(sample, "running", None),
        "scrape_ok": bool(getattr(sample, "ok", False)),
        "scale": round(be.scale(now), 4),
        "breaker": _breaker_summary(snap),
        "route_breakers": routes,
        "slots": {"total": be.pool.total, "effective": limits["total"], "in_use": use.total,
                  "shared": use.shared, "by_tier": dict(use.by_tier)},
        "queue": {"depth": {t: be.queue.depth(t) for t in be.configs}},
        "kv": {"capacity_tokens": be.spec.kv_capacity_tokens, "reserved_tokens": be.kv_in_use,
               "budget_tokens": None if be.spec.kv_capacity_tokens is None else int(be.kv_budget(now)),
               "reservation": be.spec.kv_reservation},
        "adaptive": None if be.latency is None else be.latency.snapshot(now),
    }


def _breaker_summary(snap: dict[str, Any]) -> dict[str, Any]:
    return {"state": snap.get("state"), "retry_after_s": snap.get("cooldown_left_s"),
            "manual": snap.get("manual"), "trips": snap.get("trips", 0)}
