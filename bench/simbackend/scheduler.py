"""Runs the engine in real time: one asyncio task stepping it, scaled by ``time_scale``.

Each step's effects become visible to request handlers only after the step's duration
has been slept, so a token is never seen before the simulated GPU produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .engine import Engine, Sequence, StepOutcome

log = logging.getLogger(__name__)


class ScaledClock:
    """Model time: real monotonic time times ``scale``; rescaling keeps it continuous."""

    def __init__(self, scale: float = 1.0, real: Callable[[], float] = time.monotonic) -> None:
        self._real = real
        self._base_real = real()
        self._base_model = 0.0
        self.scale = scale

    def now(self) -> float:
        return self._base_model + (self._real() - self._base_real) * self.scale

    def set_scale(self, scale: float) -> None:
        self._base_model = self.now()
        self._base_real = self._real()
        self.scale = scale

    def to_real(self, model_seconds: float) -> float:
        return model_seconds / self.scale


class Handle:
    """What a request handler sees of its sequence."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.visible = 0  # tokens per choice the client may be shown
        self.done = False
        self.finish_reason: str | None = None
        self.error: tuple[int, str] | None = None
        self._event = asyncio.Event()

    def _notify(self) -> None:
        self._event.set()

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for progress (or the timeout, so callers can check their connection)."""
        if not self._event.is_set():
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop a cancel that lands
            # as the event is set (a stream's handler cancelled on disconnect would go on)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        self._event.clear()


class Scheduler:
    def __init__(self, engine: Engine, clock: ScaledClock) -> None:
        self.engine = engine
        self.clock = clock
        self._handles: dict[Sequence, Handle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        # Aborted requests (the client went away): when their blocks came free, for measuring
        # how long a gateway's cancellation takes to reach the engine.
        self.aborts: deque[dict[str, Any]] = deque(maxlen=1000)

    def submit(self, seq: Sequence) -> Handle:
        if self._task is not None and self._task.done():
            raise RuntimeError("the simulated engine has stopped")
        handle = Handle(seq)
        self._handles[seq] = handle
        self.engine.add(seq, self.clock.now())
        self._wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        if self._handles.pop(handle.seq, None) is not None:
            state = handle.seq.state
            freed = self.engine.abort(handle.seq)
            if freed >= 0:
                self.aborts.append(
                    {
                        "request_id": handle.seq.request_id,
                        "at": time.time(),
                        "blocks": freed,
                        "was": state,
                        "generated": handle.seq.generated,
                    }
                )
            self._wake.set()

    def slow_down(self, factor: float, seconds: float) -> None:
        """Decode at 1/factor of the speed for ``seconds`` of model time from now."""
        self.engine.slow_down(factor, self.clock.now() + seconds)
        self._wake.set()

    def wake(self) -> None:
        """Something changed outside the engine (time scale, mode): re-plan now."""
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self, status: int = 503, message: str = "server shutting down") -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(status, message)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:
            # A bug here would otherwise leave every request waiting forever.
            log.exception("simulated engine crashed")
            self._fail_all(500, "simulated engine crashed")

    def _fail_all(self, status: int, message: str) -> None:
        for handle in list(self._handles.values()):
            self.engine.abort(handle.seq)
            handle.error = (status, message)
            handle.done = True
            handle._notify()
        self._handles.clear()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock.now()
            out = self.engine.step(now)
            self.steps += 1
            if out.duration > 0:
                # The GPU is busy: new arrivals wait for the next step, as in vLLM.
                await asyncio.sleep(self.clock.to_real(out.duration))
                self._deliver(out)
                continue
            self._deliver(out)
            if out.wake_at is None:
                await self._wake.wait()
                continue
            delay = max(self.clock.to_real(out.wake_at - now), 0.0005)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):  # not wait_for: see Handle.wait
                    await self._wake.wait()

    def _deliver(self, out: StepOutcome) -> None:
        for seq, generated in out.emitted.items():
            handle = self._handles.get(seq)
            if handle is not None:
                handle.visible = generated
                handle._notify()
        for seq in out.finished:
            handle = self._handles.pop(seq, None)
            if handle is not None:
                handle.visible = seq.generated
                handle.finish_reason = seq.finish_reason
                handle.done = True
                handle._notify()
        for seq in out.failed:
            handle = self._handles.pop(seq, None)
            if handle is not None:
                handle.error = seq.error
                handle.done = True
                handle._notify()
