"""The policy's ``gateway.edge``: what Envoy refuses before it asks Sluice (a part of
``extproc.policy.model``, which re-exports it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DEFAULT_KEY_PATTERN", "EdgeSettings"]

# A key Envoy passes on to Sluice: what API keys are made of (OpenAI's, the console's
# sk-sluice-..., base64url). No comma or space: two key headers joined fail it. A policy
# whose keys share a shape can say so (the console's: sk-sluice-[A-Za-z0-9_-]{43}); keep
# it short: Envoy refuses an RE2 program over 100 instructions, and a bounded repeat like
# {8,256} costs one copy per repetition.
DEFAULT_KEY_PATTERN = r"[A-Za-z0-9._~+/=-]+"


@dataclass(frozen=True)
class EdgeSettings:
    """What Envoy refuses before it asks Sluice (extproc.envoy.edge), so floods stay cheap.

    ``key_pattern`` (RE2, whole value): a request whose Authorization (``Bearer <key>``) and
    x-api-key both miss it is answered 401 by Envoy. ``per_key``: each key value is held
    to the fastest rate any tenant of the policy may go (its rpm per minute, one minute of
    burst), so a key sending more than any tier allows is refused at Envoy, never
    admitted, and cannot cost Sluice more. ``source_rps`` > 0: requests per second per
    client address (``source_burst``, default twice that): a flood of made-up keys, new
    each request, is held only by this; off by default because one address can front
    many clients (a NAT, a proxy without trusted_proxy_hops).
    """

    key_pattern: str = DEFAULT_KEY_PATTERN
    per_key: bool = True
    source_rps: float = 0.0
    source_burst: int = 0

    def __post_init__(self) -> None:
        try:
            re.compile(self.key_pattern)
        except re.error as exc:
            raise ValueError(f"key_pattern is not a regular expression: {exc}") from None
        if self.source_burst and not self.source_rps:
            raise ValueError("source_burst needs source_rps")
