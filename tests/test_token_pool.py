"""The fair tokenizing scheduler: round-robin across tenants, one slice at a time, deterministic."""

from __future__ import annotations

import asyncio

import pytest

from extproc.tokens.counter import SLICE_CHARS, CountJob, TokenCounter, TokenizerFailed
from extproc.tokens.pool import FairQueue, TokenPool


def drain(q: FairQueue[list[str]], slices_left: dict[int, int]) -> list[str]:
    """Run the queue to empty: each job is a [name] whose id needs slices_left[id] slices."""
    order = []
    while (head := q.head()) is not None:
        _, job = head
        order.append(job[0])
        slices_left[id(job)] -= 1
        q.rotate(slices_left[id(job)] == 0)
    return order


def test_round_robin_across_tenants_fifo_within_one() -> None:
    q: FairQueue[list[str]] = FairQueue()
    left: dict[int, int] = {}
    for name, tenant, n in [("a1", "A", 3), ("a2", "A", 2), ("a3", "A", 1), ("b1", "B", 2), ("c1", "C", 1)]:
        job = [name]
        left[id(job)] = n
        q.push(tenant, job)
    assert q.pending("A") == 3 and len(q) == 5
    # A's jobs one after another (one in progress), B and C served between A's slices.
    assert drain(q, left) == ["a1", "b1", "c1", "a1", "b1", "a1", "a2", "a2", "a3"]
    assert q.head() is None and len(q) == 0 and q.pending("A") == 0


def test_a_late_tenant_waits_one_slice_per_busy_tenant_not_behind_a_flood() -> None:
    q: FairQueue[list[str]] = FairQueue()
    left: dict[int, int] = {}
    for i in range(30):  # the flood: 30 jobs of 128 slices each from one key
        job = [f"junk{i}"]
        left[id(job)] = 128
        q.push("junk", job)
    order = []
    for _ in range(5):  # the flood is under way
        _, job = q.head()  # type: ignore[misc]
        order.append(job[0])
        left[id(job)] -= 1
        q.rotate(False)
    victim = ["victim"]
    left[id(victim)] = 4  # a ~25 KB prompt: 4 slices
    q.push("premium", victim)
    rest = drain(q, left)
    # The victim's 4 slices alternate with the flood's: done after 8 slices.
    assert rest[:8] == ["victim", "junk0"] * 4 or rest[:8] == ["junk0", "victim"] * 4
    assert "victim" not in rest[8:]


class LoggedJob(CountJob):
    """A real count that writes its tag to ``log`` at every slice."""

    def __init__(self, counter: TokenCounter, texts: list[str], log: list[str], tag: str,
                 fail: bool = False) -> None:
        super().__init__(counter, texts, None)
        self.log, self.tag, self.fail = log, tag, fail

    def step(self) -> bool:
        self.log.append(self.tag)
        if self.fail:
            raise TokenizerFailed("cl100k_base: PanicException: boom")
        return super().step()


def spaces_job(counter: TokenCounter, log: list[str], tag: str, chars: int) -> CountJob:
    return LoggedJob(counter, [" " * chars], log, tag)


def test_the_pool_interleaves_tenants_and_drops_cancelled_jobs() -> None:
    counter = TokenCounter("cl100k_base")
    log: list[str] = []

    async def scenario() -> None:
        pool = TokenPool()
        flood = [asyncio.ensure_future(pool.count("junk", spaces_job(counter, log, "junk", 1 << 20)))
                 for _ in range(8)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        victim = await pool.count("premium", spaces_job(counter, log, "premium", 3 * SLICE_CHARS))
        assert victim.tokens >= 3 * SLICE_CHARS // 128
        # The victim finished within one junk slice per victim slice, not behind 8 MiB.
        first = log.index("premium")
        assert log[first:first + 6] == ["premium", "junk"] * 3 or log[first - 1:first + 5] == ["junk", "premium"] * 3
        assert log.count("junk") <= first + 4
        for f in flood[1:]:
            f.cancel()
        got = await flood[0]
        assert got.tokens == counter.count([" " * (1 << 20)]).tokens
        await asyncio.sleep(0)
        # The cancelled jobs never ran past where they were: at most the first job's slices.
        assert log.count("junk") <= 2 * (1 << 20) // SLICE_CHARS + 8
        assert len(pool.queue) == 0
        pool.close()

    asyncio.run(scenario())


def test_a_failing_job_fails_its_waiter_only() -> None:
    counter = TokenCounter("cl100k_base")

    async def scenario() -> None:
        pool = TokenPool()
        bad = LoggedJob(counter, ["x" * 20_000], [], "bad", fail=True)
        good = counter.job(["hello world " * 2000])
        results = await asyncio.gather(pool.count("a", bad), pool.count("b", good), return_exceptions=True)
        assert isinstance(results[0], TokenizerFailed)
        assert results[1].tokens == counter.count(["hello world " * 2000]).tokens  # type: ignore[union-attr]
        # The pool still serves.
        assert (await pool.count("a", counter.job(["hi " * 5000]))).tokens > 0
        pool.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("n", [1, 3])
def test_the_pool_restarts_on_a_new_event_loop(n: int) -> None:
    counter = TokenCounter("cl100k_base")
    pool = TokenPool()
    for _ in range(n):
        got = asyncio.run(pool.count("a", counter.job(["word " * 5000])))
        assert got.tokens == counter.count(["word " * 5000]).tokens
    pool.close()


def test_closing_the_pool_cancels_waiters_instead_of_leaving_them_hanging() -> None:
    counter = TokenCounter("cl100k_base")

    async def scenario() -> None:
        pool = TokenPool()
        waiters = [asyncio.ensure_future(pool.count(t, counter.job([" " * (1 << 20)]))) for t in "abc"]
        await asyncio.sleep(0)
        pool.close()
        done, pending = await asyncio.wait(waiters, timeout=5)
        assert not pending and all(w.cancelled() for w in done)
        q: FairQueue[int] = FairQueue()
        q.push("x", 1)
        q.push("y", 2)
        assert q.clear() == [1, 2] and q.head() is None and len(q) == 0

    asyncio.run(scenario())


def test_many_short_messages_are_counted_a_slice_per_step_not_one_each() -> None:
    counter = TokenCounter("cl100k_base")
    texts = ["user", "a short message of a chat"] * 500  # 1,000 texts, ~14 KB
    job = counter.job(texts)
    steps = 1
    while not job.step():
        steps += 1
    assert steps <= 3
    assert job.result().tokens == sum(counter.count([t]).tokens for t in texts)
    assert counter.job([]).step() and counter.job([""]).result().tokens == 0
