"""Redis frozen past the slot leases' ttl, in seconds instead of minutes: the pool's slots in use
sampled every millisecond around each return (extproc/store/slot_leases.py, "Redis back
without the leases").

Three replicas' ``Runtime`` in one process, each with its own Redis client, lease task and
heartbeat, on a real ``redis-server`` (random port); each has more clients than the pool
takes, acquiring from its backend as admission does (a refusal for room waits for the one
lease check it woke, then tries once more) and holding a slot 50-400 ms. Redis is frozen
(SIGSTOP) for longer than the ttl, so every replica is fenced when it returns. One process
means one clock: a sample is the sum over the replicas at one instant, stricter than
sampling three processes over HTTP.

    .venv/bin/python -m bench.lease_freeze --seeds 6

Measured (6 seeds x 4 freezes, ttl 1 s): before the fixes of December (a fenced exchange
lifting a claim; a claim not covering requests in flight), 1 and 2 of 6 seeds in two runs
went over the pool, to 13-15 of 12 for up to ~100 ms after a return, and the claims were
held to ``recover_s`` after every return; after, 0 of 12 seeds over, 12 of 12 used after
each return, claims lifted within 0.07-0.13 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.redis_server import RedisServer
from extproc.backends.hold import Hold
from extproc.policy import decision
from extproc.policy.admit import SlotRequest
from extproc.policy.schema import build_policy, hash_key
from extproc.runtime.runtime import Runtime

POOL = 12
REPLICAS = 3
CLIENTS = 10  # per replica: 30 clients on 12 slots


@dataclass
class Result:
    samples: int = 0
    most_in_use: int = 0  # summed over the replicas
    most_after: int = 0  # ... in the ttl after a return
    over: list[tuple[float, list[tuple[int, int]]]] = field(default_factory=list)  # (s after a return, (in use, lease))
    recoveries: int = 0
    claims_held_s: float = 0.0  # the longest a replica still had a claim after a return


def _doc(url: str) -> dict[str, Any]:
    return {"gateway": {"state": url},
            "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": POOL,
                          "models": [{"name": "m", "context_window": 8192}]}],
            "tiers": {"t": {"priority": 1, "tpm": 100_000_000, "rpm": 10_000_000, "max_concurrency": 1000}},
            "tenants": [{"name": "a", "tier": "t", "keys": [hash_key("a")]}]}


async def run(server: RedisServer, seed: int, ttl: float, freeze: float, rounds: int) -> Result:
    """``rounds`` freezes of ``freeze`` to ``freeze + ttl / 2`` s, with the leases' and the
    registry's ttl at ``ttl``."""
    rng = random.Random(seed)
    rts = [Runtime(build_policy(_doc(server.url)), replica_id=f"f{seed}r{i}") for i in range(REPLICAS)]
    for rt in rts:
        assert rt.slot_leases is not None
        rt.state.registry.ttl_s = rt.slot_leases.ttl_s = ttl  # type: ignore[attr-defined]
        rt.slot_leases.recovery.recover_s = ttl / 2
    for rt in rts:
        await rt.first_leases()
    for rt in rts:
        await rt.state._beat(0.0)  # type: ignore[attr-defined]
    tasks = [asyncio.create_task(rt.run_leases()) for rt in rts]
    stop = asyncio.Event()
    res = Result()
    returned = [-float("inf")]

    async def sampler() -> None:
        while not stop.is_set():
            view = [(rt.backends["b"].pool.in_use().total, rt.slot_leases.leases["b"].slots)  # type: ignore[union-attr]
                    for rt in rts]
            n = sum(u for u, _ in view)
            res.samples += 1
            res.most_in_use = max(res.most_in_use, n)
            since = time.monotonic() - returned[0]
            if since < ttl:
                res.most_after = max(res.most_after, n)
                if any(rt.slot_leases.recovery.claims for rt in rts):  # type: ignore[union-attr]
                    res.claims_held_s = max(res.claims_held_s, since)
            if n > POOL:
                res.over.append((round(since, 3), view))
            await asyncio.sleep(0.001)

    async def client(rt: Runtime) -> None:
        be = rt.backends["b"]
        while not stop.is_set():
            req = SlotRequest("t", "a", None, 0, may_queue=False)
            got = be.acquire(req, rt.clock())
            if not isinstance(got, Hold) and be.lease_wait is not None and got.cause in decision.ROOM_CAUSES:
                await be.lease_wait()
                got = be.acquire(req, rt.clock())
            if isinstance(got, Hold):
                await asyncio.sleep(rng.uniform(0.05, 0.4))
                be.release(got, rt.clock())
            else:
                await asyncio.sleep(rng.uniform(0.0, 0.02))

    clients = [asyncio.create_task(client(rt)) for rt in rts for _ in range(CLIENTS)]
    sampling = asyncio.create_task(sampler())
    try:
        for _ in range(rounds):
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            server.pause()
            try:
                await asyncio.sleep(freeze + rng.uniform(0.0, ttl / 2))
            finally:
                server.resume()
            returned[0] = time.monotonic()
            await asyncio.sleep(ttl * 1.2)
    finally:
        stop.set()
        await asyncio.gather(*clients, sampling)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rt in rts:
            assert rt.slot_leases is not None
            res.recoveries += rt.slot_leases.recovery.recoveries
            await rt.state.aclose()  # type: ignore[attr-defined]
            rt.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4, help="freezes per seed")
    ap.add_argument("--ttl", type=float, default=1.0, help="the leases' and the registry's ttl, s")
    ap.add_argument("--freeze", type=float, default=1.3, help="shortest freeze, s (longest: + ttl / 2)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            bad = 0
            for seed in range(args.seeds):
                r = asyncio.run(run(server, seed, args.ttl, args.freeze, args.rounds))
                bad += bool(r.over)
                print(f"seed {seed}: {r.samples} samples, most in use {r.most_in_use} / {POOL} "
                      f"({r.most_after} in the ttl after a return), {r.recoveries} recoveries, claims held "
                      f"<= {r.claims_held_s:.2f} s (recover_s {args.ttl / 2:.2f}), "
                      f"{len(r.over)} samples over the pool {r.over[:3]}")
            print(f"{bad} of {args.seeds} seeds went over the pool")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
