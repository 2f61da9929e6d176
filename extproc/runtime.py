"""Everything a stream needs that outlives it: the policy snapshot, the state, metrics.

The policy is swapped whole; a stream pins the snapshot it started with, so a reload
mid-request never changes the rules a request was admitted under, and accounting
(kept in ``state`` and the backends, keyed by name) survives the swap.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from extproc import tokenizer
from extproc.backends import BackendRuntime
from extproc.estimate import DecodeRates
from extproc.metrics import Metrics
from extproc.policy.completions import CompletionEstimator
from extproc.policy.schema import Policy
from extproc.policy.state import TokenState
from extproc.scrape import scrape_status
from extproc.store import open_state, state_url
from extproc.token_pool import TokenPool
from extproc.ttft_counts import BOUNDS_MS as TTFT_BOUNDS_MS
from extproc.ttft_counts import TtftCounts

log = logging.getLogger("sluice.runtime")

# A prompt that fits in one slice is counted at once: it costs no more than one slice
# of the fair scheduler, which is the most any stream waits for another's count.
OFFLOAD_CHARS = tokenizer.SLICE_CHARS


class Runtime:
    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 replica_id: str | None = None) -> None:
        self.clock = clock
        self.metrics = Metrics()
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        # gateway.state (or $SLUICE_REDIS_URL) is read once: a store is not swapped live.
        self.state_url = state_url(policy.gateway)
        self.state: TokenState = open_state(policy.gateway, self.replica_id, self.metrics.state_store_up.set)
        starter = getattr(self.state, "start", None)
        if starter is not None:
            starter()  # a shared store registers this replica before the first request
        self.token_pool = TokenPool()
        self.encodings: dict[str, tokenizer.Counter] = {}
        self.policy = policy
        self.etag = ""
        self.backends: dict[str, BackendRuntime] = {}
        self.tenant_in_flight: Counter[str] = Counter()
        self.rejections: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.degradations: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.decode_rates = DecodeRates()  # for usage estimates when none arrives
        # Learned completion lengths: runtime state, so they survive policy swaps.
        self.completions = CompletionEstimator()
        self.ttft_counts = TtftCounts()  # for the console's TTFT percentiles, across reloads
        self._load_encodings(policy)
        self._sync_backends(policy)
        self.metrics.policy_ok.set(1)

    def _load_encodings(self, policy: Policy) -> None:
        for _, model in policy.by_model.values():
            if model.encoding not in self.encodings:
                self.encodings[model.encoding] = tokenizer.Counter(model.encoding)

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

    @property
    def shared_state(self) -> bool:
        """True when limits are kept in a store shared by every replica (not in this process)."""
        return bool(getattr(self.state, "shared", False))

    def swap(self, policy: Policy, etag: str = "") -> None:
        if state_url(policy.gateway) != self.state_url:
            log.warning("gateway.state changed to %r: restart extproc to move state there", policy.gateway.state)
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
    async def count_prompt(self, encoding: str, texts: list[str], *, tenant: str = "-",
                           limit: int | None = None) -> tokenizer.Count:
        """Count ``texts``, stopping once past ``limit``; raises ``TokenizerFailed``.

        Large prompts go through the fair scheduler, slice by slice, so one tenant's
        flood of long prompts waits behind itself; the time is metered per tenant.
        """
        job = self.encodings[encoding].job(texts, limit)
        try:
            if sum(len(t) for t in texts) <= OFFLOAD_CHARS:
                while not job.step():
                    pass
                return job.result()
            return await self.token_pool.count(tenant, job)
        finally:
            self.metrics.child(self.metrics.tokenize_seconds, tenant).inc(job.seconds)

    async def count_tokens(self, encoding: str, texts: list[str]) -> int:
        return (await self.count_prompt(encoding, texts)).tokens

    def count_tokens_now(self, encoding: str, texts: list[str]) -> int:
        """For settle paths that cannot await (a stream being torn down)."""
        try:
            return self.encodings[encoding].count(texts).tokens
        except tokenizer.TokenizerFailed as exc:
            log.warning("counting a completion failed (%s); estimating 1 token per 4 characters", exc)
            return tokenizer.estimate(texts)

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        st = self.state.snapshot(now)
        st["backends"] = {name: backend_status(be, now) for name, be in self.backends.items()}
        st["ttft_bounds_ms"] = list(TTFT_BOUNDS_MS)
        for name, b in st["backends"].items():
            b["ttft_counts"] = self.ttft_counts.report(name)
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
        self.token_pool.close()
        closer = getattr(self.state, "close", None)
        if closer is not None:
            closer()  # a shared store gets its leases back


def backend_status(be: BackendRuntime, now: float) -> dict[str, Any]:
    sample = be.sample
    use = be.pool.in_use()
    limits = be.pool.effective_limits(be.slot_scale(now))
    snap = be.breaker.snapshot(now)
    routes = {model: {**_breaker_summary(b.snapshot(now)), "tenant_breakers": be.tenants_for(model).snapshot(now)}
              for model, b in be.route_breakers.items()}
    return {
        **scrape_status(sample, be.kv_in_use, be.spec.kv_capacity_tokens, be.has_metrics),
        "waiting": getattr(sample, "waiting", None),
        "running": getattr(sample, "running", None),
        "scrape_ok": bool(getattr(sample, "ok", False)),
        "scale": round(be.scale(now), 4),
        "breaker": _breaker_summary(snap),
        "route_breakers": routes,
        "tenant_breakers": be.tenant_breakers.snapshot(now),
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
