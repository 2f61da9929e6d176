"""Everything a stream needs that outlives it: the policy snapshot, the state, metrics.

The policy is swapped whole; a stream pins the snapshot it started with, so a reload
mid-request never changes the rules a request was admitted under, and accounting
(kept in ``state``, keyed by tenant name) survives the swap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import tiktoken

from extproc import tokens
from extproc.metrics import Metrics
from extproc.policy.gate import LocalState
from extproc.policy.schema import Policy

log = logging.getLogger("sluice.runtime")

# Below this many characters tokenizing costs less than a hop to a thread.
OFFLOAD_CHARS = 16 * 1024


class Runtime:
    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 tokenize_threads: int = 2) -> None:
        self.clock = clock
        self.metrics = Metrics()
        self.state = LocalState()
        self.executor = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="sluice-tokenize")
        self.encodings: dict[str, tiktoken.Encoding] = {}
        self.policy = policy
        self._load_encodings(policy)
        self.metrics.policy_ok.set(1)

    def _load_encodings(self, policy: Policy) -> None:
        for _, model in policy.by_model.values():
            if model.encoding not in self.encodings:
                self.encodings[model.encoding] = tokens.get_encoding(model.encoding)

    def swap(self, policy: Policy) -> None:
        self._load_encodings(policy)
        self.policy = policy
        self.state.forget(set(policy.tenants))
        log.info("policy swapped: %d tenants, %d backends", len(policy.tenants), len(policy.backends))

    async def count_tokens(self, encoding: str, texts: list[str]) -> int:
        enc = self.encodings[encoding]
        size = sum(len(t) for t in texts)
        if size < OFFLOAD_CHARS:
            return sum(len(enc.encode_ordinary(t)) for t in texts)
        # tiktoken releases the GIL: a 128 KiB prompt costs ~7-30 ms, which other
        # streams on the event loop must not wait for.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.count_tokens_now, encoding, texts)

    def count_tokens_now(self, encoding: str, texts: list[str]) -> int:
        """For settle paths that cannot await (a stream being torn down)."""
        enc = self.encodings[encoding]
        return sum(len(enc.encode_ordinary(t)) for t in texts)

    def status(self) -> dict[str, object]:
        return self.state.snapshot(self.clock())

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
