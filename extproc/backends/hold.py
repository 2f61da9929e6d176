"""What an admitted request holds on a backend until it settles."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy.slots import SlotGrant


@dataclass(frozen=True)
class Hold:
    """What an admitted request holds on a backend: a slot and its KV footprint."""

    grant: SlotGrant
    kv: int
    endpoint: str | None = None  # the pool endpoint it was placed on (host:port)
    affinity: str | None = None  # prefix affinity's part in that: hit | spill | miss (None: off)
    second: str | None = None  # where Envoy retries if ``endpoint`` refuses the connection; nothing held there
