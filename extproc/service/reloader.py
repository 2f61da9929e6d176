"""Hot reload of policy files: poll cheaply, swap whole, keep the last good snapshot."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from extproc.policy.schema import PolicyError
from extproc.policyfile import fingerprint, load_policy
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.reload")


async def watch_policy_dir(runtime: Runtime, directory: Path, interval_s: float = 1.0) -> None:
    seen = fingerprint(directory)
    while True:
        await asyncio.sleep(interval_s)
        current = fingerprint(directory)
        if current == seen:
            continue
        seen = current
        reload_once(runtime, directory)


def reload_once(runtime: Runtime, directory: Path) -> bool:
    try:
        policy = load_policy(directory)
    except PolicyError as exc:
        runtime.metrics.policy_reloads.labels("invalid").inc()
        runtime.metrics.policy_ok.set(0)
        log.error("policy in %s is invalid; keeping the last good one:\n%s", directory, exc)
        return False
    except OSError as exc:
        runtime.metrics.policy_reloads.labels("unreadable").inc()
        runtime.metrics.policy_ok.set(0)
        log.error("cannot read policy in %s (%s); keeping the last good one", directory, exc)
        return False
    runtime.swap(policy)
    runtime.metrics.policy_reloads.labels("ok").inc()
    runtime.metrics.policy_ok.set(1)
    return True
