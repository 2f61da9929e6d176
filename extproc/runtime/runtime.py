"""Everything a stream needs that outlives it: the policy snapshot, the state, metrics.

The policy is swapped whole; a stream pins the snapshot it started with, so a reload
mid-request never changes the rules a request was admitted under, and accounting
(kept in ``state`` and the backends, keyed by name) survives the swap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from extproc.backends.state import BackendState
from extproc.policy.breaker import Breaker
from extproc.policy.completions import CompletionEstimator
from extproc.policy.decode_rate import DecodeRates
from extproc.policy.schema import Backend, Policy
from extproc.policy.share import leased_view, local_share, zero_shares
from extproc.policy.state import BudgetState, TokenState
from extproc.runtime import leases
from extproc.runtime.metrics import Metrics
from extproc.runtime.settle_log import SettleLog
from extproc.runtime.ttft_counts import BOUNDS_MS as TTFT_BOUNDS_MS
from extproc.runtime.ttft_counts import TtftCounts
from extproc.runtime.usage_history import UsageHistory
from extproc.store import open_budgets, open_state, state_url
from extproc.store.pool_lease import PoolLease
from extproc.store.shared_breakers import SharedBreakers
from extproc.store.slot_leases import SlotLeases
from extproc.tokens import counter
from extproc.tokens.pool import TokenPool

log = logging.getLogger("sluice.runtime")

# A prompt that fits in one slice is counted at once: it costs no more than one slice
# of the fair scheduler, which is the most any stream waits for another's count.
OFFLOAD_CHARS = counter.SLICE_CHARS
# How often breaker trips are exchanged with the other replicas (a shared store).
BREAKER_SYNC_S = 0.25


class Runtime:
    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 replica_id: str | None = None, share: int = 1, metrics: Metrics | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall  # epoch seconds: budgets count calendar periods (tests pass their own)
        # One of ``share`` worker processes on a shared store: per-process limits (slots,
        # KV, concurrency caps) are cut to this process's part (extproc.policy.share).
        self.share = share
        self.metrics = metrics or Metrics()  # tests may pass tests.metrics_fake.RecordingMetrics
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        # gateway.state (or $SLUICE_REDIS_URL) is read once: a store is not swapped live.
        self.state_url = state_url(policy.gateway)
        self.state: TokenState = open_state(policy.gateway, self.replica_id, self.metrics.state_store_up.set)
        starter = getattr(self.state, "start", None)
        if starter is not None:
            starter()  # a shared store registers this replica before the first request
        # Budgets live beside the buckets: in this process, or in the same Redis.
        self.budgets: BudgetState = open_budgets(policy.gateway, self.state)
        self.usage = UsageHistory()  # per tenant, model and hour, for the console
        # With a shared store, backends' slots and KV are leased from pools in it.
        self.slot_leases: SlotLeases | None = None
        self._lease_lock = asyncio.Lock()
        self.shared_breakers: SharedBreakers | None = None
        if self.shared_state:
            st: Any = self.state
            self.slot_leases = SlotLeases(st.client, st.registry, st.prefix)
            self.shared_breakers = SharedBreakers(st.client, lambda: st.registry.member, st.prefix)
        self.full_policy = policy
        policy = self._local(policy)
        self.token_pool = TokenPool()
        self.encodings: dict[str, counter.TokenCounter] = {}
        self.policy = policy
        self.etag = ""
        self.backends: dict[str, BackendState] = {}
        self.tenant_in_flight: Counter[str] = Counter()
        self.decode_rates = DecodeRates()  # for usage estimates when none arrives
        # Learned completion lengths: runtime state, so they survive policy swaps.
        self.completions = CompletionEstimator()
        self.ttft_counts = TtftCounts()  # for the console's TTFT percentiles, across reloads
        self.settle_log = SettleLog()  # what each request was charged, for /debug/settled
        self._load_encodings(policy)
        self._sync_backends(policy)
        self.metrics.policy_ok.set(1)
        # Called after every swap, with no await in between (serve --eds-dir writes Envoy's
        # endpoint files there, extproc.envoy.eds).
        self.on_swap: list[Callable[[], None]] = []
        # Applied to every policy swapped in, before anything else: what a source outside the
        # policy files adds (a pool's endpoints from the cluster, extproc.service.kube_pool).
        self.transforms: list[Callable[[Policy], Policy]] = []

    def _load_encodings(self, policy: Policy) -> None:
        for _, model in policy.by_model.values():
            if model.encoding not in self.encodings:
                self.encodings[model.encoding] = counter.TokenCounter(model.encoding)

    def _configured(self, spec: Backend, policy: Policy) -> tuple[Backend, Policy]:
        """The backend as this replica admits to it: its leased part of the pool, if leased."""
        if self.slot_leases is None:
            return spec, policy
        return leased_view(spec, policy, self.full_policy, leases.held(spec.name, self.slot_leases)[0])

    def _sync_backends(self, policy: Policy) -> None:
        now = self.clock()
        for spec in policy.backends:
            be = self.backends.get(spec.name)
            local_spec, local_policy = self._configured(spec, policy)
            if be is None:
                be = self.backends[spec.name] = BackendState.create(local_spec, local_policy, now)
            else:
                be.reconfigure(local_spec, local_policy, now)
            if self.slot_leases is not None:
                self._place_lease(be)
        # A removed backend keeps its runtime until its in-flight requests settle;
        # they hold references to it, so dropping it from the map is enough.
        for name in [n for n in self.backends if n not in {b.name for b in policy.backends}]:
            del self.backends[name]

    @property
    def shared_state(self) -> bool:
        """True when limits are kept in a store shared by every replica (not in this process)."""
        return bool(getattr(self.state, "shared", False))

    def _local(self, policy: Policy) -> Policy:
        self.full_policy = policy
        if self.share == 1:
            return policy
        local = local_share(policy, self.share, pools=self.slot_leases is None)
        for what in zero_shares(local):
            log.warning("one of %d workers: %s in this worker's share (floor(limit / %d))",
                        self.share, what, self.share)
        return local

    def swap(self, policy: Policy, etag: str = "") -> None:
        for transform in self.transforms:
            policy = transform(policy)
        policy = self._local(policy)
        if state_url(policy.gateway) != self.state_url:
            log.warning("gateway.state changed to %r: restart extproc to move state there", policy.gateway.state)
        self._load_encodings(policy)
        self._sync_backends(policy)
        self.policy = policy
        self.etag = etag
        self.state.forget(set(policy.tenants))
        self.budgets.forget(set(policy.tenants))
        log.info("policy swapped: %d tenants, %d backends", len(policy.tenants), len(policy.backends))
        for listener in self.on_swap:
            listener()

    # -- slot and KV leases (a shared store) ---------------------------------------------
    async def lease_tick(self) -> int:
        """One check of every pool lease (a backend's, or each endpoint's of a pool); applies the
        changed ones. Returns how many changed."""
        if self.slot_leases is None:
            return 0
        async with self._lease_lock:  # one exchange in flight per lease
            waiting = self.slot_leases.begin_check()
            try:
                usage: dict[str, Callable[[], tuple[int, ...]]] = {}
                for spec in self.full_policy.backends:
                    be = self.backends.get(spec.name)
                    if be is not None:
                        usage.update(leases.usage(spec, be, self.slot_leases, self.clock))
                changed = await self.slot_leases.tick(usage, self._apply_lease)
            finally:
                self.slot_leases.end_check(waiting)
        return len(changed)

    def _place_lease(self, be: BackendState) -> None:
        """The backend's KV cap and its endpoints' leases from what this replica holds."""
        assert self.slot_leases is not None
        be.kv_lease = leases.held(be.spec.name, self.slot_leases)[1]
        leases.place_leases(be, self.slot_leases)
        if be.on_short is None:
            shared = self.slot_leases
            be.on_short = lambda b, kv, now: leases.on_short(shared, b, kv, now)
            # A tier without a queue waits for that one check rather than be refused at once
            # (bounded: a throttled wake waits check_s, the exchange timeout_s, plus loop lag).
            # Not while the lease exchanges fail (next_check returns at once): no lease can grow,
            # and a refusal must stay quick. The token store's breaker is not that signal: it
            # opens on a bucket exchange slower than admit_wait_s (8 ms; a busy host trips it
            # without an outage), while the lease exchange, allowed timeout_s, still grows the
            # lease: skipping the wait then refuses a KV-short request "slots" with room in the pool.
            be.lease_wait = lambda: shared.next_check(max(0.5, shared.timeout_s + 2 * shared.check_s))

    def _apply_lease(self, name: str, lease: PoolLease) -> None:
        name = leases.backend_of(name)
        be = self.backends.get(name)
        spec = next((b for b in self.policy.backends if b.name == name), None)
        if be is None or spec is None:
            return
        now = self.clock()
        local_spec, local_policy = self._configured(spec, self.policy)
        be.reconfigure(local_spec, local_policy, now)
        self._place_lease(be)
        be.queue.pump(now)

    async def first_leases(self, timeout_s: float = 3.0) -> None:
        """Before serving: wait (briefly) for the store's registration, then take the pool leases.

        Until then a replica on a shared store has 0 slots on every backend."""
        if self.slot_leases is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.slot_leases.registry.member and loop.time() < deadline:
            await asyncio.sleep(0.02)
        try:
            await self.lease_tick()
        except Exception as exc:  # noqa: BLE001 - run_leases keeps trying
            log.warning("slot leases not taken at start (%s); admitting nothing until they are", exc)

    async def run_leases(self) -> None:
        """Keep the pool leases (``extproc.store.slot_leases``) until cancelled."""
        assert self.slot_leases is not None
        me = asyncio.current_task()
        breakers_at = 0.0
        while True:
            if me is not None and me.cancelling():
                # Cancelled, but the CancelledError was lost on the way: redis-py awaits
                # asyncio.wait_for, which in Python 3.11 returns a result that comes in with
                # the cancel instead of raising it (seen: this loop went on for ever and a
                # test awaiting the cancelled task hung).
                raise asyncio.CancelledError
            try:
                await self.lease_tick()
            except Exception:  # noqa: BLE001 - a bug here must not stop the leases being renewed
                log.exception("slot leases: tick failed")
            if self.shared_breakers is not None and self.clock() >= breakers_at:
                breakers_at = self.clock() + BREAKER_SYNC_S
                try:
                    await self.shared_breakers.sync(self.breakers(), self.clock())
                except Exception as exc:  # noqa: BLE001 - the store down: breakers stay local
                    log.debug("shared breakers: %s", exc)
            await self.slot_leases.wait()  # check_s, or sooner when an acquire found its lease short

    def breakers(self) -> dict[str, Breaker]:
        """Every backend's, model route's and pool endpoint's breaker, by the name they are
        shared under: ``backend``, ``backend/model``, ``backend@host:port`` (as its metrics)."""
        out: dict[str, Breaker] = {}
        for name, be in self.backends.items():
            out[name] = be.breaker
            out.update({f"{name}/{model}": b for model, b in be.route_breakers.items()})
            if be.endpoints is not None:
                out.update({f"{name}@{key}": st.breaker for key, st in be.endpoints.by_key.items()})
        return out

    # -- per-tenant bookkeeping for status reports ------------------------------
    def track(self, tenant: str, delta: int) -> None:
        self.tenant_in_flight[tenant] += delta

    # -- tokenizing ------------------------------------------------------------------
    async def count_prompt(self, encoding: str, texts: list[str], *, tenant: str = "-",
                           limit: int | None = None, per_text: bool = False) -> counter.Count:
        """Count ``texts``, stopping once past ``limit`` (each text's own, ``per_text``);
        raises ``TokenizerFailed``.

        Large prompts go through the fair scheduler, slice by slice, so one tenant's
        flood of long prompts waits behind itself; the time is metered per tenant.
        """
        enc = self.encodings[encoding]
        chars = sum(len(t) for t in texts)
        if chars <= counter.SHORT_CHARS:
            got = enc.count_short(texts, limit, per_text)
            self.metrics.tokenized(tenant, got.seconds)
            return got
        job = enc.job(texts, limit, per_text)
        try:
            if chars <= OFFLOAD_CHARS:
                while not job.step():
                    pass
                return job.result()
            return await self.token_pool.count(tenant, job)
        finally:
            self.metrics.tokenized(tenant, job.seconds)

    async def count_tokens(self, encoding: str, texts: list[str]) -> int:
        return (await self.count_prompt(encoding, texts)).tokens

    def count_tokens_now(self, encoding: str, texts: list[str]) -> int:
        """For settle paths that cannot await (a stream being torn down)."""
        try:
            return self.encodings[encoding].count(texts).tokens
        except counter.TokenizerFailed as exc:
            log.warning("counting a completion failed (%s); estimating 1 token per 4 characters", exc)
            return counter.estimate(texts)

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        st = self.state.snapshot(now)
        st.setdefault("store", {"kind": "memory", "up": True})
        if self.slot_leases is not None and isinstance(st.get("store"), dict):
            st["store"]["slot_leases"] = self.slot_leases.snapshot()
        if self.shared_breakers is not None and isinstance(st.get("store"), dict):
            st["store"]["breakers"] = self.shared_breakers.snapshot()
        st["backends"] = {name: be.status(now) for name, be in self.backends.items()}
        st["ttft_bounds_ms"] = list(TTFT_BOUNDS_MS)
        for name, b in st["backends"].items():
            b["ttft_counts"] = self.ttft_counts.report(name)
        st["policy_etag"] = self.etag
        st["tenants"] = self.tenant_status(now)
        st["completions"] = self.completions.snapshot()
        st["budgets"] = self.budgets.snapshot(self.wall())
        st["usage"] = self.usage.report()
        return st

    def tenant_status(self, now: float) -> dict[str, Any]:
        out = {}
        for name, tenant in self.policy.tenants.items():
            limits = self.policy.limits(tenant)
            tv, _ = self.state.view(name, limits, now)
            out[name] = {"tier": tenant.tier, "in_flight": self.tenant_in_flight.get(name, 0),
                         "tokens_remaining": tv.remaining, "tpm": limits.tpm,
                         "rejections": dict(self.metrics.tenant_rejections.get(name, {})),
                         "degraded": dict(self.metrics.tenant_degradations.get(name, {}))}
        return out

    def close(self) -> None:
        self.token_pool.close()
        if self.slot_leases is not None:
            self.slot_leases.release_all_sync(getattr(self.state, "url", None))
        closer = getattr(self.budgets, "close", None)
        if closer is not None:
            closer()  # shared budgets send their last settles
        closer = getattr(self.state, "close", None)
        if closer is not None:
            closer()  # a shared store gets its leases back
