"""Waiting in tests for something that happens on its own time: one helper, polled.

For processes the test does not drive (Envoy, extproc, the console, a reload): what a
test waits for is a condition, never a fixed sleep. Time the test drives itself is a
fake clock moved by assignment (see tests/test_backend_queue.py), not this.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually", "eventually_async"]

What = str | Callable[[], str]  # a callable is asked only on failure (a log's tail, the last state)


def _say(what: What, timeout: float) -> str:
    return f"not within {timeout} s: {what() if callable(what) else what}"


def eventually(check: Callable[[], Any], timeout: float, what: What, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy (and return that), or fail saying ``what``.

    ``check`` may raise ``AssertionError`` to stop the wait at once (a process that exited)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, _say(what, timeout)
        time.sleep(interval)


async def eventually_async(check: Callable[[], Any], timeout: float, what: What, interval: float = 0.05) -> Any:
    """``eventually`` inside an event loop: the loop runs on between polls."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, _say(what, timeout)
        await asyncio.sleep(interval)
