"""A fair scheduler for tokenizing: one slice at a time, round-robin across tenants.

Counting a long prompt is split into slices (``extproc.tokens.counter``). The scheduler
runs one slice of the tenant at the head of its ring, moves that tenant to the back,
and yields to the event loop before the next slice. So

- one tenant has at most one count in progress; its other prompts wait behind it
  (FIFO), which is where a flood of junk from one key queues: behind itself;
- another tenant's prompt waits at most one slice per other busy tenant
  (a slice is bounded: ``SLICE_CHARS`` characters, ~0.3 ms of English here);
- every other stream on the event loop waits at most one slice between its own
  callbacks, and tokenizing never takes more than the one core the loop runs on.

bpe-openai holds the GIL while it counts, so a worker thread would not keep the loop
free anyway; slices on the loop are the honest way to share it. ``FairQueue`` is the
pure, deterministic part (unit-tested); ``TokenPool`` drives it on the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from extproc.tokens.counter import Count, CountJob

J = TypeVar("J")


class FairQueue(Generic[J]):
    """Per-tenant FIFO queues served round-robin; no I/O, no clock."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[J]] = {}
        self._ring: deque[str] = deque()

    def push(self, tenant: str, job: J) -> None:
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = deque()
            self._ring.append(tenant)
        q.append(job)

    def head(self) -> tuple[str, J] | None:
        """The job to run a slice of next (the same until ``rotate``)."""
        if not self._ring:
            return None
        tenant = self._ring[0]
        return tenant, self._queues[tenant][0]

    def rotate(self, finished: bool) -> None:
        """After a slice of the head job: drop it if ``finished``, then the next tenant's turn."""
        tenant = self._ring.popleft()
        q = self._queues[tenant]
        if finished:
            q.popleft()
        if q:
            self._ring.append(tenant)
        else:
            del self._queues[tenant]

    def pending(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def clear(self) -> list[J]:
        """Remove and return every queued job."""
        jobs = [j for q in self._queues.values() for j in q]
        self._queues.clear()
        self._ring.clear()
        return jobs

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())


@dataclass(slots=True)
class _Entry:
    job: CountJob
    future: asyncio.Future[Count]


class TokenPool:
    """Runs ``CountJob``s slice by slice on the running event loop, fairly across tenants."""

    def __init__(self) -> None:
        self.queue: FairQueue[_Entry] = FairQueue()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def pending(self, tenant: str) -> int:
        return self.queue.pending(tenant)

    async def count(self, tenant: str, job: CountJob) -> Count:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Count] = loop.create_future()
        self.queue.push(tenant, _Entry(job, fut))
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="sluice-token-pool")
        assert self._wake is not None
        self._wake.set()
        # A cancelled waiter (client gone) cancels fut; the loop drops the job unrun.
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            head = self.queue.head()
            if head is None:
                wake.clear()
                await wake.wait()
                continue
            _, entry = head
            if entry.future.done():  # its stream went away
                self.queue.rotate(True)
                continue
            try:
                done = entry.job.step()
            except Exception as exc:  # TokenizerFailed, or a bug: fail this job, keep serving
                done = True
                entry.future.set_exception(exc)
            if done and not entry.future.done():
                entry.future.set_result(entry.job.result())
            self.queue.rotate(done)
            await asyncio.sleep(0)

    def close(self) -> None:
        """Stop the scheduler; waiters still queued are cancelled, not left hanging."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for entry in self.queue.clear():
            if not entry.future.done() and not entry.future.get_loop().is_closed():
                entry.future.cancel()
