"""Micro-benchmark of the admission hot path, in process: route (breakers, ladder) +
acquire_slot (decide) + release, per request, with 20 requests held.

    .venv/bin/python -m bench.admit_bench [--n 20000] [--rounds 7]

Prints the median and the best round in microseconds per request. On a shared machine
compare runs interleaved, or count instructions (``valgrind --tool=callgrind``, the
difference between ``--n 3000`` and ``--n 0`` divided by 3000).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy import kv as kvmath
from extproc.policy.schema import Policy, build_policy, hash_key
from extproc.request.admission import SlotWait, route
from extproc.request.ticket import Ticket
from extproc.runtime.runtime import Runtime
from extproc.wire.peer import PeerStream


def policy() -> Policy:
    return build_policy({
        "backends": [{"name": "b", "address": "127.0.0.1:1", "max_concurrency": 64, "kv_capacity_tokens": 100000,
                      "kv_block_size": 16, "models": [{"name": "m", "context_window": 4096}]}],
        "tiers": {"hi": {"priority": 10, "tpm": 10**9, "rpm": 10**9, "guaranteed_slots": 8, "max_queue_depth": 3,
                         "max_queue_wait_ms": 1000},
                  "lo": {"priority": 1, "tpm": 10**9, "rpm": 10**9, "max_queue_depth": 3, "max_queue_wait_ms": 1000}},
        "tenants": [{"name": "a", "tier": "hi", "keys": [hash_key("a")]},
                    {"name": "z", "tier": "lo", "keys": [hash_key("z")]}],
    })


def run(n: int, rounds: int) -> list[float]:
    p = policy()
    rt = Runtime(p, clock=lambda: 0.0)
    be = rt.backends["b"]
    be.has_metrics = False
    backend, model = p.by_model["m"]
    tenant = p.tenants["z"]
    tier = p.tiers[tenant.tier]
    slot = SlotWait(rt, tier, tenant.name, p.limits(tenant).max_concurrency, PeerStream(_no_messages()),
                    lambda reason: False)  # the peer is never read here: nothing queues
    kv = kvmath.footprint(600, be.kv_block_size)

    def admit(now: float) -> Ticket:
        ticket = route(rt, p, tier, tenant.name, backend, model, 100, now)
        ticket.kv = kv
        slot.acquire(ticket, now)
        return ticket

    for _ in range(20):
        admit(0.0)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            now = i * 1e-4
            ticket = admit(now)
            assert ticket.hold is not None
            be.release(ticket.hold, now)
        out.append((time.perf_counter() - t0) / max(n, 1) * 1e6)
    rt.close()
    return out


async def _no_messages() -> AsyncIterator[pb.ProcessingRequest]:
    return
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    res = run(a.n, a.rounds)
    print(f"route + slot acquire + release: median {statistics.median(res):.2f} us, best {min(res):.2f} us per request")


if __name__ == "__main__":
    main()
