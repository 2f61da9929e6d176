"""Background loops at the edge: scrape backends, keep gauges fresh.

The scrape feeds the watermark controller (capacity scale) and the breaker
(preemption counter). A short refresh keeps the gauges current and turns breaker
transitions into metrics and log lines. The admission queues have their own tick
(``extproc.service.ticker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from extproc.backends.endpoints import EndpointState
from extproc.backends.pool_report import pool_summary
from extproc.backends.resolve import resolve_later
from extproc.backends.scrape import (
    Sample,
    engine_metrics,
    kv_source,
    reserved_fraction,
    scrape_once,
)
from extproc.backends.state import BackendState
from extproc.policy import kv as kvmath
from extproc.policy.breaker import Breaker
from extproc.policy.engine_metrics import EngineMetrics
from extproc.policy.watermark import WatermarkController
from extproc.runtime.metrics import Metrics
from extproc.runtime.runtime import Runtime
from extproc.service.series import SeriesPruner

log = logging.getLogger("sluice.monitor")
TICK_S = 0.1


def metric_names(be: BackendState) -> EngineMetrics:
    return engine_metrics(be.spec.engine, be.spec.metric_names)


async def scrape_backend(rt: Runtime, name: str, session: aiohttp.ClientSession) -> None:
    while True:
        be = rt.backends.get(name)
        if be is None:
            return
        interval = be.spec.watermark.scrape_interval_s
        if be.spec.metrics_url:
            sample = await scrape_once(session, be.spec.metrics_url, metric_names(be),
                                       timeout_s=max(0.2, min(interval, 2.0)))
            if rt.backends.get(name) is not be:
                return  # removed while scraping: no series for it again
            previous, be.sample = be.sample, sample
            apply_sample(rt.metrics, name, be, sample, rt.clock())
            report_change(rt.metrics, name, be.spec.metrics_url, previous, sample,
                          kv_bound=be.spec.kv_capacity_tokens is not None)
        if be.endpoints is not None:
            await scrape_endpoints(rt, name, be, session, timeout_s=max(0.2, min(interval, 2.0)))
        await asyncio.sleep(interval)


async def scrape_endpoints(rt: Runtime, name: str, be: BackendState, session: aiohttp.ClientSession,
                           timeout_s: float) -> None:
    """Scrape every endpoint of a pool at once; each feeds its own watermark and breaker."""
    assert be.endpoints is not None
    for st in be.endpoints.by_key.values():
        if st.ip is None:
            await resolve_later(st)
    targets = [st for st in be.endpoints.by_key.values() if st.spec.metrics_url]
    names = metric_names(be)
    samples = await asyncio.gather(*(scrape_once(session, st.spec.metrics_url or "", names, timeout_s=timeout_s)
                                     for st in targets))
    now = rt.clock()
    for st, sample in zip(targets, samples, strict=True):
        if be.endpoints.by_key.get(st.key) is not st:
            continue  # drained and forgotten while scraping
        label = f"{name}@{st.key}"
        previous, st.sample = st.sample, sample
        apply_endpoint_sample(rt.metrics, label, st, sample, now)
        report_change(rt.metrics, label, st.spec.metrics_url or "", previous, sample,
                      kv_bound=st.spec.kv_capacity_tokens is not None)


def apply_endpoint_sample(m: Metrics, label: str, st: EndpointState, sample: Sample, now: float) -> None:
    # Unreachable: ejected from picking until it answers again.
    _apply(m, label, st.wm, st.breaker, sample, now, "endpoint", st.spec.kv_capacity_tokens is not None)


def apply_sample(m: Metrics, name: str, be: BackendState, sample: Sample, now: float) -> None:
    _apply(m, name, be.wm, be.breaker, sample, now, "backend", be.spec.kv_capacity_tokens is not None)


def _apply(m: Metrics, label: str, wm: WatermarkController, breaker: Breaker, sample: Sample, now: float,
           what: str, kv_bound: bool = True) -> None:
    """One scrape into a watermark and a breaker: a backend's, or one endpoint's of a pool."""
    source = kv_source(sample, kv_bound)
    if source == "saturated":
        # Unreachable metrics count as saturated, never as idle; so do unusable ones
        # (``problem``) when no kv_capacity_tokens lets Sluice's reservations bound KV.
        wm.observe(None, None, now)
        m.scrape_errors.labels(label).inc()
        log.debug("scrape of %s failed: %s", label, sample.error)
        return
    if sample.state == "problem":
        m.scrape_errors.labels(label).inc()
    # Without the engine's KV (no KV metric, no series yet, a setup problem) Sluice's own
    # reservations bound KV (kv_fits against kv_capacity_tokens) and the engine queue alone
    # drives the watermark: feeding the reservations in as well would count them twice.
    wm.observe(sample.kv_usage if source == "engine" else 0.0, sample.waiting, now)
    if source == "engine":
        m.kv_usage.labels(label).set(sample.kv_usage or 0.0)
    if sample.waiting is not None:
        m.backend_waiting.labels(label).set(sample.waiting)
    if sample.preemptions is not None and breaker.observe_preemptions(sample.preemptions, now):
        log.warning("%s %s: preemptions rising, breaker tripped", what, label)


def report_change(m: Metrics, name: str, url: str, previous: object | None, sample: Sample,
                  kv_bound: bool = True) -> None:
    """Say once, loudly, when a backend's metrics become unusable, and when they recover."""
    was = previous.problem if isinstance(previous, Sample) and previous.state == "problem" else ""
    now_problem = sample.problem if sample.state == "problem" else ""
    if now_problem:
        m.metrics_problem.labels(name, now_problem).set(1)
    if was == now_problem:
        return
    if was:
        m.metrics_problem.labels(name, was).set(0)
        log.warning("backend %s: metrics at %s no longer %s (now %s)", name, url, was,
                    sample.problem if now_problem else sample.state)
    if now_problem:
        meanwhile = ("Admitting by Sluice's own KV reservations until this is fixed" if kv_bound else
                     "Counted as saturated until this is fixed (no kv_capacity_tokens: nothing else bounds "
                     "its KV cache)")
        log.error("backend %s: metrics at %s cannot be used (%s: %s): %s. %s", name, url, now_problem,
                  sample.error, sample.hint, meanwhile)
    if sample.state == "no_series" and not (isinstance(previous, Sample) and previous.state == "no_series"):
        log.info("backend %s: no KV series at %s yet (the engine creates it at its first batch); "
                 "admitting by Sluice's own KV reservations", name, url)


def refresh(rt: Runtime) -> None:
    now = rt.clock()
    m = rt.metrics
    for name, be in rt.backends.items():
        scale = be.scale(now)
        m.scale.labels(name).set(scale)
        if be.has_metrics and kv_source(be.sample, be.spec.kv_capacity_tokens is not None) == "reservations":
            m.kv_usage.labels(name).set(reserved_fraction(be.kv_in_use, be.spec.kv_capacity_tokens) or 0.0)
        m.slots_effective.labels(name).set(be.pool.effective_limits(be.slot_scale(now))["total"])
        m.concurrency_limit.labels(name).set(
            be.adaptive_limit.limit(now) if be.adaptive_limit else be.spec.max_concurrency
        )
        if be.endpoints is not None:
            refresh_endpoints(m, name, be, now)
        use = be.pool.in_use()
        for tier in be.pool.tier_order:
            m.slots_in_use.labels(name, "guaranteed", tier).set(use.guaranteed.get(tier, 0))
            m.slots_in_use.labels(name, "shared", tier).set(use.shared_by_tier.get(tier, 0))
            m.queue_depth.labels(name, tier).set(be.queue.depth(tier))
        refresh_shares(m, name, be, now)
        # A model route's breaker is labelled backend/model.
        breakers = {name: be.breaker, **{f"{name}/{model}": b for model, b in be.route_breakers.items()}}
        for label, breaker in breakers.items():
            state = breaker.state(now).value
            for s in ("closed", "open", "half_open"):
                m.breaker_state.labels(label, s).set(1 if s == state else 0)
            for ev in breaker.drain_events():
                m.breaker_transitions.labels(label, str(ev.from_state), str(ev.to_state), ev.cause).inc()
                log.warning("breaker %s: %s -> %s (%s)", label, ev.from_state, ev.to_state, ev.cause)
        tenants = {name: be.tenant_breakers, **{f"{name}/{model}": t for model, t in be.route_tenant_breakers.items()}}
        for label, tb in tenants.items():
            by_state = tb.by_state(now)
            for s in ("closed", "open", "half_open"):
                m.tenant_breakers.labels(label, s).set(by_state.get(s, 0))
            for tenant, ev in tb.drain_events():
                if ev.to_state == "open":
                    m.tenant_breaker_trips.labels(label, tenant).inc()
                    log.warning("tenant breaker %s %s: open (%s)", label, tenant, ev.cause)


def refresh_shares(m: Metrics, name: str, be: BackendState, now: float) -> None:
    """KV shares per tier, the revocations, and each tier's fair share (docs/long-context.md)."""
    for tier in be.queue.configs:
        diff, jain = be.queue.order.fairness(tier, now)
        m.fair_difference.labels(name, tier).set(diff)
        m.fair_jain.labels(name, tier).set(jain)
    if not be.kv_shares:
        return
    budget = kvmath.kv_budget(be, now)
    for tier in be.priorities:
        share = be.kv_shares.get(tier)
        m.kv_reserved.labels(name, tier).set(be.kv_by_tier.get(tier, 0))
        guaranteed = 0.0 if share is None or budget == float("inf") else share.guaranteed * budget
        m.kv_guaranteed.labels(name, tier).set(guaranteed)
    counts, wasted = be.shares.revocations.drain()
    for (tier, kind), n in counts.items():
        m.revocations.labels(name, tier, kind).inc(n)
    for tier, n in wasted.items():
        m.revoked_work.labels(name, tier).inc(n)


def refresh_endpoints(m: Metrics, name: str, be: BackendState, now: float) -> None:
    assert be.endpoints is not None
    # The pool's own KV and queue series are its endpoints' sums (it has no scrape of its own).
    pool = pool_summary(be.endpoints, now)
    if pool["kv_usage"] is not None:
        m.kv_usage.labels(name).set(pool["kv_usage"])
    if pool["waiting"] is not None:
        m.backend_waiting.labels(name).set(pool["waiting"])
    for state in ("total", "usable", "unreadable"):
        m.pool_endpoints.labels(name, state).set(pool["endpoints" if state == "total" else state])
    for key, st in be.endpoints.by_key.items():
        m.endpoint_in_flight.labels(name, key).set(st.in_flight)
        m.endpoint_kv_reserved.labels(name, key).set(st.kv_in_use)
        m.endpoint_usable.labels(name, key).set(1 if st.usable(now) else 0)
        for ev in st.breaker.drain_events():  # labelled backend@host:port, like its scrape gauges
            m.breaker_transitions.labels(f"{name}@{key}", str(ev.from_state), str(ev.to_state), ev.cause).inc()
            log.warning("endpoint breaker %s@%s: %s -> %s (%s)", name, key, ev.from_state, ev.to_state, ev.cause)
        if st.spec.metrics_url and kv_source(st.sample, st.spec.kv_capacity_tokens is not None) == "reservations":
            m.kv_usage.labels(f"{name}@{key}").set(reserved_fraction(st.kv_in_use, st.spec.kv_capacity_tokens) or 0.0)


def refresh_budgets(rt: Runtime) -> None:
    """Each budgeted tenant's standing in its current period, as gauges (a new period
    reads 0 from its first second, whether or not the tenant sent a request)."""
    m, wall, policy = rt.metrics, rt.wall(), rt.policy
    for name, tenant in policy.tenants.items():
        budget = policy.budget(tenant)
        if budget is None:
            continue
        view = rt.budgets.view(name, budget, wall)
        for unit, limit, used in (("tokens", budget.tokens, view.used.tokens),
                                  ("cost", budget.cost_nanos, view.used.nanos)):
            if limit is not None:
                scale = 1e9 if unit == "cost" else 1
                m.budget_limit.labels(name, unit).set(limit / scale)
                m.budget_used.labels(name, unit).set(used / scale)
        fraction = view.fraction
        m.budget_used_ratio.labels(name).set(fraction)
        for a in budget.alerts:
            m.budget_alert.labels(name, f"{a:g}").set(1 if fraction >= a else 0)


BUDGET_REFRESH_TICKS = 10  # once a second


async def run_monitor(rt: Runtime) -> None:
    tasks: dict[str, asyncio.Task[None]] = {}
    pruner = SeriesPruner()  # the series of backends and endpoints that left the policy go
    ticks = 0
    async with aiohttp.ClientSession() as session:
        try:
            while True:
                for name in rt.backends:
                    t = tasks.get(name)
                    if t is None or t.done():
                        tasks[name] = asyncio.create_task(scrape_backend(rt, name, session))
                refresh(rt)
                ticks += 1
                if ticks % BUDGET_REFRESH_TICKS == 0:
                    refresh_budgets(rt)
                pruner.maybe_prune(rt.metrics, rt.backends, rt.clock())
                await asyncio.sleep(TICK_S)
        finally:
            for t in tasks.values():
                t.cancel()
            for t in tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await t
