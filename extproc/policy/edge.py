"""The limits Envoy enforces before it asks Sluice, resolved from the policy.

A refusal from Sluice costs a gRPC round trip to Python (~0.3 ms of a core); one from
Envoy costs Envoy alone. So what Envoy can decide without Sluice's state is decided there
(``extproc.envoy.edge`` renders it):

- a request with no key of the right shape (``gateway.edge.key_pattern``) gets 401;
- each key is limited to the fastest rate *any* tenant of the policy may go: its RPM over
  a minute, with a minute of burst, the shape of Sluice's own RPM bucket. A key over that
  rate would be refused by Sluice whatever its tenant, so Envoy refusing it first loses
  nothing (``edge_rate_limited``, 429);
- with ``source_rps`` set, each client address is limited too: the one thing that holds
  a flood of made-up keys, new on every request.

Pure: the policy in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.policy.model import DEFAULT_KEY_PATTERN, Policy

__all__ = ["EdgeLimits", "edge_limits"]


@dataclass(frozen=True)
class EdgeLimits:
    key_pattern: str = DEFAULT_KEY_PATTERN
    key_per_s: int = 0  # token refill per second for each key value; 0: no per-key limit
    key_burst: int = 0
    source_per_s: int = 0  # for each client address; 0: none
    source_burst: int = 0


def edge_limits(policy: Policy) -> EdgeLimits:
    e = policy.gateway.edge
    key_per_s = key_burst = 0
    if e.per_key:
        rpms = [t.rpm for t in policy.tiers.values()] + [
            t.rpm for t in policy.tenants.values() if t.rpm is not None
        ]
        fastest = max(rpms, default=0)
        if fastest > 0:
            # Refilled each second: a whole token more than a minute's share, never less.
            key_per_s = math.ceil(fastest / 60)
            key_burst = fastest + key_per_s
    source_per_s = math.ceil(e.source_rps) if e.source_rps > 0 else 0
    source_burst = (e.source_burst or 2 * source_per_s) if source_per_s else 0
    return EdgeLimits(e.key_pattern, key_per_s, key_burst, source_per_s, source_burst)
