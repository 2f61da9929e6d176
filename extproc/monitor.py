"""Background loops at the edge: scrape backends, keep gauges fresh, wake waiters.

The scrape feeds the watermark controller (capacity scale) and the breaker
(preemption counter). A short tick hands capacity that came back over time to
queued requests, and turns breaker transitions into metrics and log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from extproc.backends import BackendRuntime
from extproc.runtime import Runtime
from extproc.scrape import PRESETS, scrape_once

log = logging.getLogger("sluice.monitor")
TICK_S = 0.1


def metric_names(be: BackendRuntime) -> dict[str, tuple[str, ...]]:
    names = dict(PRESETS[be.spec.engine])
    names.update(be.spec.metric_names)
    return names


async def scrape_backend(rt: Runtime, name: str, session: aiohttp.ClientSession) -> None:
    while True:
        be = rt.backends.get(name)
        if be is None:
            return
        interval = be.spec.watermark.scrape_interval_s
        if be.spec.metrics_url:
            sample = await scrape_once(session, be.spec.metrics_url, metric_names(be),
                                       timeout_s=max(0.2, min(interval, 2.0)))
            now = rt.clock()
            be.sample = sample
            m = rt.metrics
            if sample.ok:
                be.wm.observe(sample.kv_usage, sample.waiting, now)
                m.kv_usage.labels(name).set(sample.kv_usage or 0.0)
                if sample.waiting is not None:
                    m.backend_waiting.labels(name).set(sample.waiting)
                if sample.preemptions is not None and be.breaker.observe_preemptions(sample.preemptions, now):
                    log.warning("backend %s: preemptions rising, breaker tripped", name)
            else:
                # Unreachable or unreadable metrics count as saturated, never as idle.
                be.wm.observe(None, None, now)
                m.scrape_errors.labels(name).inc()
                log.debug("scrape of %s failed: %s", name, sample.error)
        await asyncio.sleep(interval)


def refresh(rt: Runtime) -> None:
    now = rt.clock()
    m = rt.metrics
    for name, be in rt.backends.items():
        if be.queue.depth():
            be.pump(now)
        scale = be.scale(now)
        m.scale.labels(name).set(scale)
        m.slots_effective.labels(name).set(be.pool.effective_limits(be.slot_scale(now))["total"])
        m.concurrency_limit.labels(name).set(be.latency.limit(now) if be.latency else be.spec.max_concurrency)
        use = be.pool.in_use()
        for tier in be.pool.tier_order:
            m.slots_in_use.labels(name, "guaranteed", tier).set(use.guaranteed.get(tier, 0))
            m.slots_in_use.labels(name, "shared", tier).set(use.shared_by_tier.get(tier, 0))
            m.queue_depth.labels(name, tier).set(be.queue.depth(tier))
        # A model route's breaker is labelled backend/model.
        breakers = {name: be.breaker, **{f"{name}/{model}": b for model, b in be.route_breakers.items()}}
        for label, breaker in breakers.items():
            state = breaker.state(now).value
            for s in ("closed", "open", "half_open"):
                m.breaker_state.labels(label, s).set(1 if s == state else 0)
            for ev in breaker.drain_events():
                m.breaker_transitions.labels(label, str(ev.from_state), str(ev.to_state), ev.cause).inc()
                log.warning("breaker %s: %s -> %s (%s)", label, ev.from_state, ev.to_state, ev.cause)


async def run_monitor(rt: Runtime) -> None:
    tasks: dict[str, asyncio.Task[None]] = {}
    async with aiohttp.ClientSession() as session:
        try:
            while True:
                for name in rt.backends:
                    t = tasks.get(name)
                    if t is None or t.done():
                        tasks[name] = asyncio.create_task(scrape_backend(rt, name, session))
                refresh(rt)
                await asyncio.sleep(TICK_S)
        finally:
            for t in tasks.values():
                t.cancel()
            for t in tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await t
