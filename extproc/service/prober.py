"""Sluice's own probes of its backends, so a breaker's verdict never waits on traffic.

Two questions only requests could answer before:

- **Is a half-open breaker's backend serving again?** A half-open breaker lets one probe
  request through and then ramps up on a timer; under light traffic (or when placement
  sends a pool's requests to the other engines) no request came, and an engine stayed
  half-open for 16 minutes. When a breaker has waited ``own_probe_after_s`` for a probe
  (``Breaker.probe_due``: the backend's, a model route's, or one pool engine's), Sluice
  takes the probe place itself and records how its own request went.
- **Is a failure the backend's or its tenant's?** With no other tenant succeeding, one
  tenant's 5xx proves nothing about the backend (a body that makes the engine fail, sent
  when nobody else is): it is the tenant's until Sluice's own request fails too
  (``TenantBreakers.probe_wanted`` / ``probed``; a pool is asked on every engine, and a
  failure on any is the backend's). A failing probe is recorded as the backend's failure.

The request is ``extproc.backends.probe``'s; at most one is in flight per question.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator

import aiohttp

from extproc.backends.probe import ProbeResult, probe
from extproc.backends.state import BackendState
from extproc.policy.breaker import Breaker
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.tenant_breakers import TenantBreakers
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.prober")
TICK_S = 0.5


def _outcome(r: ProbeResult) -> Outcome:
    return Outcome.FAILURE if r.failed else Outcome.SUCCESS


def targets(be: BackendState) -> dict[str, str]:
    """Where a probe of the whole backend goes: its address, or every resolved engine of a pool."""
    if be.endpoints is None:
        return {"": f"http://{be.spec.host}:{be.spec.port}"}
    return {
        key: f"http://{st.destination}"
        for key, st in be.endpoints.by_key.items()
        if st.ip is not None
    }


class Prober:
    def __init__(
        self,
        rt: Runtime,
        session: aiohttp.ClientSession,
        send: Callable[[aiohttp.ClientSession, str, str, str], Awaitable[ProbeResult]]
        | None = None,
    ) -> None:
        self.rt, self.session = rt, session
        self._send = send or (lambda s, url, kind, model: probe(s, url, kind, model))
        self.in_flight: dict[tuple[str, ...], asyncio.Task[None]] = {}

    def tick(self) -> None:
        """Start every probe that is due and not already running."""
        now = self.rt.clock()
        for name, be in list(self.rt.backends.items()):
            where = targets(be)
            if not where:
                continue
            for key, breaker, url, kind, model in self._half_open_due(name, be, where, now):
                self._start(key, self._half_open, name, breaker, url, kind, model)
            for key, tb, breaker, kind, model in self._blame_due(name, be, now):
                self._start(key, self._blame, name, be, tb, breaker, where, kind, model)

    @staticmethod
    def _half_open_due(
        name: str, be: BackendState, where: dict[str, str], now: float
    ) -> Iterator[tuple[tuple[str, ...], Breaker, str, str, str]]:
        """(key, breaker, url, probe kind, model) of each half-open breaker no request probed:
        the backend's, a model route's, a pool engine's."""
        kind, first = be.spec.breaker.probe, be.spec.models[0].name
        url = next(iter(where.values()))
        if be.breaker.probe_due(now):
            yield ("half_open", name), be.breaker, url, kind, first
        for model, rb in be.route_breakers.items():
            if rb.probe_due(now):
                yield ("half_open", name, model), rb, url, be.route_settings[model].probe, model
        for key, st in be.endpoints.by_key.items() if be.endpoints is not None else ():
            if key in where and st.breaker.probe_due(now):
                yield ("half_open", name, "@" + key), st.breaker, where[key], kind, first

    @staticmethod
    def _blame_due(
        name: str, be: BackendState, now: float
    ) -> Iterator[tuple[tuple[str, ...], TenantBreakers, Breaker, str, str]]:
        """(key, tenant breakers, the breaker a confirmed failure counts on, probe kind, model)
        of each failure that waits for Sluice's own probe."""
        if be.tenant_breakers.probe_wanted(now):
            yield (
                ("blame", name),
                be.tenant_breakers,
                be.breaker,
                be.spec.breaker.probe,
                be.spec.models[0].name,
            )
        for model, tb in be.route_tenant_breakers.items():
            if tb.probe_wanted(now):
                yield (
                    ("blame", name, model),
                    tb,
                    be.route_breakers[model],
                    be.route_settings[model].probe,
                    model,
                )

    def _start(
        self,
        key: tuple[str, ...],
        job: Callable[..., Coroutine[object, object, None]],
        *args: object,
    ) -> None:
        running = self.in_flight.get(key)
        if running is None or running.done():
            self.in_flight[key] = asyncio.ensure_future(job(*args))

    async def _half_open(
        self, name: str, breaker: Breaker, url: str, kind: str, model: str
    ) -> None:
        if not breaker.allow(self.rt.clock()).allowed:
            return  # a request took the probe place meanwhile
        r = await self._send(self.session, url, kind, model)
        breaker.record(_outcome(r), r.seconds, self.rt.clock())
        self.rt.metrics.probes.labels(name, "half_open", "failed" if r.failed else "ok").inc()
        log.info(
            "own probe of half-open %s at %s: %s (status %s)",
            name,
            url,
            "failed" if r.failed else "ok",
            r.status,
        )

    async def _blame(
        self,
        name: str,
        be: BackendState,
        tb: TenantBreakers,
        breaker: Breaker,
        where: dict[str, str],
        kind: str,
        model: str,
    ) -> None:
        results = dict(
            zip(
                where,
                await asyncio.gather(
                    *(self._send(self.session, url, kind, model) for url in where.values())
                ),
                strict=True,
            )
        )
        now = self.rt.clock()
        failed = [key for key, r in results.items() if r.failed]
        tb.probed(bool(failed), now)
        if failed:
            # Confirmed: the backend fails for Sluice too. Its breakers count it as theirs.
            breaker.record(Outcome.FAILURE, None, now)
            if be.endpoints is not None:
                for key in failed:
                    st = be.endpoints.by_key.get(key)
                    if st is not None:
                        st.breaker.record(Outcome.FAILURE, None, now)
        self.rt.metrics.probes.labels(name, "blame", "failed" if failed else "ok").inc()
        log.warning(
            "a failure no other tenant could vouch for on %s: Sluice's own probe %s",
            name,
            f"failed at {', '.join(k or 'its address' for k in failed)}" if failed else "passed",
        )

    async def close(self) -> None:
        for t in self.in_flight.values():
            t.cancel()
        for t in self.in_flight.values():
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def run_prober(rt: Runtime, interval_s: float = TICK_S) -> None:
    async with aiohttp.ClientSession() as session:
        prober = Prober(rt, session)
        try:
            while True:
                prober.tick()
                await asyncio.sleep(interval_s)
        finally:
            await prober.close()
