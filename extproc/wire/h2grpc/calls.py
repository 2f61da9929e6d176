"""Handlers for the two kinds of method the picker serves: ``unary`` (a function of the one
request) and ``streaming`` (a task reading and writing, with an optional ``fast`` hook that
answers a message in the read callback itself)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from extproc.wire.h2grpc.status import CANCELLED, INTERNAL, OK, UNKNOWN
from extproc.wire.h2grpc.stream import Handler, Stream

log = logging.getLogger("sluice.h2grpc")

T = TypeVar("T")


class Unary:
    """A unary method: ``fn(request bytes, peer)`` -> (status, response bytes or None, message)."""

    def __init__(self, st: Stream, fn: Callable[[bytes, str], tuple[int, bytes | None, str]]) -> None:
        self.st, self.fn = st, fn
        self.request: bytes | None = None

    def on_message(self, data: bytes) -> None:
        if self.request is None:
            self.request = data

    def on_end(self) -> None:
        try:
            status, body, message = self.fn(self.request or b"", self.st.peer)
        except Exception:
            log.exception("h2grpc: unary %s failed", self.st.path)
            status, body, message = INTERNAL, None, "internal error"
        if body is not None:
            self.st.send(body)
        self.st.finish(status, message)

    def on_cancel(self) -> None:
        pass


def unary(fn: Callable[[bytes, str], tuple[int, bytes | None, str]]) -> Handler:
    return lambda st: Unary(st, fn)


class Call:
    """A streaming method run as a task, like grpc.aio's ``context.read()``/``write()``:
    ``read()`` is the next message (None once the peer half-closed), ``write()`` queues one.

    ``fast``, when given, sees each message first while the task is parked in ``read()`` with
    nothing queued; returning True means it was handled there and then (its answer already
    written), so the task is not woken for it. It must do exactly what the task would."""

    __slots__ = ("st", "q", "waiter", "ended", "task", "fast")

    def __init__(self, st: Stream, run: Callable[[Call], Awaitable[None]],
                 fast: Callable[[Call, bytes], bool] | None = None) -> None:
        self.st = st
        self.q: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.fast = fast
        self.task = asyncio.get_running_loop().create_task(self._run(run))

    @property
    def peer(self) -> str:
        return self.st.peer

    async def _run(self, run: Callable[[Call], Awaitable[None]]) -> None:
        try:
            await run(self)
        except asyncio.CancelledError:
            self.st.finish(CANCELLED, "cancelled")
            return
        except Exception as exc:  # the handler logs what it must; the peer gets the status
            self.st.finish(UNKNOWN, f"{type(exc).__name__}")
            return
        self.st.finish(OK)

    def on_message(self, data: bytes) -> None:
        if self.fast is not None and self.waiter is not None and not self.q:
            try:
                if self.fast(self, data):
                    return
            except Exception:
                self.fast = None
                self.task.cancel()
                self.st.finish(UNKNOWN, "handler failed")
                return
        self.q.append(data)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_end(self) -> None:
        self.ended = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_cancel(self) -> None:
        self.ended = True
        self.task.cancel()

    async def read(self) -> bytes | None:
        while not self.q:
            if self.ended:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.q.popleft()

    def write(self, message: bytes) -> None:
        self.st.send(message)


def streaming(run: Callable[[Call], Awaitable[None]], fast: Callable[[Call, bytes], bool] | None = None) -> Handler:
    return lambda st: Call(st, run, fast)


class Messages(Generic[T]):
    """A streaming call's messages, parsed, as the async iterator grpc.aio hands a handler
    (what ``extproc.wire.peer.PeerStream`` reads)."""

    __slots__ = ("call", "parse")

    def __init__(self, call: Call, parse: Callable[[bytes], T]) -> None:
        self.call, self.parse = call, parse

    def __aiter__(self) -> Messages[T]:
        return self

    async def __anext__(self) -> T:
        data = await self.call.read()
        if data is None:
            raise StopAsyncIteration
        return self.parse(data)
