"""One request of Sluice's own to a backend (or one engine of a pool): is it serving?

Asked when a breaker is half-open and no request came to probe it, and when a failure
has no other tenant to vouch for or against the backend (``extproc.service.prober``).
The request is the smallest a backend can serve (``BreakerSettings.probe``): a one-token
completion (or chat completion), an embedding of one word, or ``GET /health``. It carries
no tenant (the engine's own record does not bill it) and an ``x-request-id`` of its own.

The verdict: the backend failed when it answered 5xx, or did not answer within the
timeout; any other answer (a 4xx included: it read the request and refused it) says it
is serving.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

USER_AGENT = "sluice-probe"
TIMEOUT_S = 10.0
_ids = itertools.count(1)


@dataclass(frozen=True)
class ProbeResult:
    failed: bool
    status: int  # 0: no answer
    seconds: float


def request_for(kind: str, model: str) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) of a probe of ``kind`` (extproc.policy.model.PROBES)."""
    if kind == "health":
        return "GET", "/health", None
    if kind == "chat":
        return (
            "POST",
            "/v1/chat/completions",
            {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]},
        )
    if kind == "embeddings":
        return "POST", "/v1/embeddings", {"model": model, "input": "ping"}
    return "POST", "/v1/completions", {"model": model, "prompt": "ping", "max_tokens": 1}


async def probe(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    model: str,
    timeout_s: float = TIMEOUT_S,
) -> ProbeResult:
    method, path, body = request_for(kind, model)
    headers = {"user-agent": USER_AGENT, "x-request-id": f"sluice-probe-{next(_ids)}"}
    t0 = time.monotonic()
    try:
        async with session.request(
            method,
            base_url + path,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            await r.read()
            return ProbeResult(r.status >= 500, r.status, time.monotonic() - t0)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return ProbeResult(True, 0, time.monotonic() - t0)
