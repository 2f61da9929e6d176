"""The engine's waiting queue, in vLLM's two scheduling policies (``--scheduling-policy``).

``fcfs``: arrival order; a preempted sequence goes back to the front (vLLM's
``prepend_request``). ``priority``: ordered by ``(priority, arrival)``, lower first, as
vLLM's ``PriorityRequestQueue`` (a heap on the same key); a preempted sequence goes back
in its place by that key, since it keeps its priority and its arrival.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from .sequence import Sequence

POLICIES = ("fcfs", "priority")


def order_key(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival


class WaitQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, not {policy!r}")
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._sorted: list[Sequence] = []

    @property
    def by_priority(self) -> bool:
        return self.policy == "priority"

    def append(self, seq: Sequence) -> None:
        """A new arrival."""
        if self.by_priority:
            bisect.insort(self._sorted, seq, key=order_key)
        else:
            self._fifo.append(seq)

    def prepend(self, seq: Sequence) -> None:
        """A preempted sequence coming back."""
        if self.by_priority:
            bisect.insort(self._sorted, seq, key=order_key)
        else:
            self._fifo.appendleft(seq)

    def head(self) -> Sequence:
        return self._sorted[0] if self.by_priority else self._fifo[0]

    def popleft(self) -> Sequence:
        return self._sorted.pop(0) if self.by_priority else self._fifo.popleft()

    def remove(self, seq: Sequence) -> None:
        (self._sorted if self.by_priority else self._fifo).remove(seq)

    def __len__(self) -> int:
        return len(self._sorted) if self.by_priority else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._sorted if self.by_priority else self._fifo)
