"""Running the app: on the current loop (the CLI) or in a background thread (tests, demo)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web

from .app import STATE, SimState, create_app
from .config import SimConfig


async def start_site(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``app``; returns the runner (to clean up) and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # frees the sequence's KV blocks without waiting for the next poll.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, int(bound)


class BackgroundServer:
    """The simulated backend on its own event loop thread.

    with BackgroundServer(SimConfig(time_scale=10)) as sim:
        httpx.post(sim.url + "/v1/chat/completions", json=...)
    """

    def __init__(self, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.config = config or SimConfig()
        self.host = host
        self.port = port
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> SimState:
        assert self.app is not None
        return self.app[STATE]

    def start(self, timeout: float = 15.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._main, name="simbackend", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("simulated backend did not start")
        if self._error is not None:
            raise RuntimeError("simulated backend failed to start") from self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self.app = create_app(self.config)
            self._runner, self.port = loop.run_until_complete(
                start_site(self.app, self.host, self.port)
            )
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's loop (engine state is not thread-safe)."""
        assert self._loop is not None
        fut: asyncio.Future[Any] = asyncio.run_coroutine_threadsafe(_call(fn, *args), self._loop)
        return fut.result(10)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(15)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
