"""Talking to the console (control plane) over HTTP: policy in, live status out.

The policy is long-polled with its ETag, so an operator's change reaches every
replica within about a second without hammering the console; while the console is
down the last good snapshot stays in force. Status goes out once a second, and its
answer brings the console's durable copy of the current budget periods' spend, which
a replica (or Redis) that lost a period's count starts again from (``seed``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aiohttp

from extproc.policy.budget import Amount
from extproc.policy.schema import PolicyError, build_policy
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.console")
LONG_POLL_S = 25


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None: JSON has neither, and the
    console refuses a report that carries them (one bad gauge must not cost the whole report)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class ConsoleClient:
    def __init__(self, runtime: Runtime, url: str, token: str, replica_id: str, status_interval_s: float = 1.0):
        self.rt = runtime
        self.url = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {token}"}
        self.replica = replica_id
        self.status_interval_s = status_interval_s

    async def fetch_policy(self, session: aiohttp.ClientSession, wait_s: int) -> bool:
        """One (long) poll; True when a new policy was applied."""
        headers = dict(self.headers)
        if self.rt.etag:
            headers["if-none-match"] = self.rt.etag
        params = {"wait": str(wait_s)} if self.rt.etag and wait_s else {}
        timeout = aiohttp.ClientTimeout(total=wait_s + 10)
        async with session.get(f"{self.url}/api/v1/policy", headers=headers, params=params,
                               timeout=timeout) as r:
            if r.status == 304:
                return False
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status,
                                                  message=await r.text())
            doc = await r.json()
            etag = r.headers.get("etag", "")
        try:
            policy = build_policy(doc)
        except PolicyError as exc:
            self.rt.metrics.policy_reloads.labels("invalid").inc()
            self.rt.metrics.policy_ok.set(0)
            log.error("console served an invalid policy (etag %s); keeping the last good one:\n%s", etag, exc)
            self.rt.etag = etag  # do not fetch the same bad document again and again
            return False
        self.rt.swap(policy, etag)
        self.rt.metrics.policy_reloads.labels("ok").inc()
        self.rt.metrics.policy_ok.set(1)
        return True

    async def fetch_policy_once(self) -> bool:
        async with aiohttp.ClientSession() as session:
            return await self.fetch_policy(session, 0)

    async def poll_policy(self, session: aiohttp.ClientSession) -> None:
        backoff = 0.5
        while True:
            try:
                await self.fetch_policy(session, LONG_POLL_S)
                backoff = 0.5
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                log.warning("console policy poll failed (%s); keeping the current policy", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def take_spend(self, rows: Any) -> int:
        """Seed the budget books with the console's copy; returns how many periods it named."""
        n = 0
        for r in rows if isinstance(rows, list) else []:
            try:
                self.rt.budgets.seed(str(r["tenant"]), str(r["key"]),
                                     Amount(int(r["settled_tokens"]), int(r["settled_nanos"])))
                n += 1
            except (KeyError, TypeError, ValueError):
                continue
        return n

    async def fetch_spend_once(self) -> int:
        """Before serving: the budget periods' spend as the console has it (a restarted
        replica with in-process budgets would otherwise start its periods from zero)."""
        async with aiohttp.ClientSession() as session, session.get(
                f"{self.url}/api/v1/budgets", headers=self.headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, r.history, status=r.status,
                                                  message=await r.text())
            return self.take_spend((await r.json()).get("budget_spend"))

    def status_document(self) -> dict[str, Any]:
        st = self.rt.status()
        st["replica"] = self.replica
        st["at"] = time.time()
        return finite(st)

    async def report_status(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with session.post(f"{self.url}/api/v1/replicas/{self.replica}/status",
                                        json=self.status_document(), headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status >= 300:
                        log.warning("console refused status report: HTTP %s", r.status)
                    else:
                        self.take_spend((await r.json()).get("budget_spend"))
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                log.debug("status report failed: %s", exc)
            await asyncio.sleep(self.status_interval_s)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(self.poll_policy(session), self.report_status(session))
