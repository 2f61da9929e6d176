"""A replica reduced to its pool lease, for tests/test_slot_leases.py to SIGKILL and SIGSTOP.

``python -m tests.slot_lease_holder URL PREFIX TTL WANT``: registers in the registry,
leases WANT slots of the pool ``b`` (16 slots), and keeps the lease and the
registration every ttl/3, printing a line on every change (``held N``, ``fenced``,
``member M``).
"""

from __future__ import annotations

import asyncio
import sys

from extproc.store.client import connect
from extproc.store.registry import Registry
from extproc.store.slot_leases import SlotLeases

POOL = 16


async def main(url: str, prefix: str, ttl: float, want: int) -> None:
    client = connect(url, socket_timeout_s=2.0)
    registry = Registry("holder", prefix, ttl)
    leases = SlotLeases(client, registry, prefix, ttl_s=ttl, timeout_s=2.0)
    await registry.beat(client, "", asyncio.get_running_loop().time())
    print(f"member {registry.member}", flush=True)
    leases.lease("b", POOL, 0)
    held, fenced = -1, 0
    while True:
        # The lease first: after a pause it is the script that finds the member gone.
        ls = await leases.exchange("b", want, 0)
        if leases.fenced != fenced:
            fenced = leases.fenced
            print("fenced", flush=True)
        if ls.slots != held:
            held = ls.slots
            print(f"held {held}", flush=True)
        if registry.due(asyncio.get_running_loop().time()):
            before = registry.member
            if await registry.beat(client, "", asyncio.get_running_loop().time()):
                print("fenced", flush=True)  # paused between lease and heartbeat: the registry saw it first
            if registry.member != before:
                print(f"member {registry.member}", flush=True)
        await asyncio.sleep(ttl / 3)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
