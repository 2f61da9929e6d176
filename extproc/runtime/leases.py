"""Which pool leases a replica keeps (``extproc.store.slot_leases``), how big, and where they land.

A backend with one address is one leased pool, named after the backend: its
``max_concurrency`` slots and ``kv_capacity_tokens × kv_overcommit`` KV tokens. A
backend with ``endpoints:`` is one pool per endpoint, named ``<backend>@<host:port>``,
with that endpoint's slots and KV: the replicas together never hold more than an
engine's own cache, and this replica's backend admits from the sum of its endpoint
leases while placement (``extproc.backends.endpoints``) puts each request on an endpoint where
this replica's own lease has room.

What a lease is kept at is what is in use plus what waits for room, plus a block:
waiting counts the backend's queued requests (for a pool, placed where they would go
if the leases could grow, ``EndpointSet.plan``) and the requests refused for room
since the last check (``SlotLeases.short``). An acquire refused because its lease is
full (``on_short``, the backend's hook) wakes the lease task at once; the grant pumps
the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from extproc.policy.schema import Backend

if TYPE_CHECKING:
    from extproc.backends.state import BackendState
    from extproc.store.slot_leases import SlotLeases


def kv_pool(capacity: int | None, overcommit: float) -> int:
    """The KV tokens a pool leases out (0: no KV budget)."""
    return 0 if capacity is None else int(capacity * overcommit)


def endpoint_lease(backend: str, key: str) -> str:
    return f"{backend}@{key}"


def backend_of(name: str) -> str:
    """The backend a lease name belongs to."""
    return name.split("@", 1)[0]


def held(backend: str, leases: SlotLeases) -> tuple[int, int]:
    """What this replica leases of ``backend``: (slots, kv), summed over its endpoints for a pool."""
    ls = leases.leases.get(backend)
    if ls is not None:
        return ls.slots, ls.kv
    pre = f"{backend}@"
    parts = [ls for name, ls in leases.leases.items() if name.startswith(pre)]
    return sum(p.slots for p in parts), sum(p.kv for p in parts)


def usage(spec: Backend, be: BackendState, leases: SlotLeases,
          clock: Callable[[], float]) -> dict[str, Callable[[], tuple[int, ...]]]:
    """``SlotLeases.tick``'s input for one backend: lease name -> a function of (pool slots, pool
    kv, wanted slots, wanted kv, exact, slots in use, kv in use), read when the lease is decided. Takes (and clears)
    the refusals recorded since the last check."""
    oc = spec.kv_overcommit
    if be.endpoints is None:
        def one() -> tuple[int, ...]:
            waiting = [kv for _, kv in be.waiting()]
            s, k = leases.short.pop(spec.name, (0, 0))
            busy = be.pool.in_use().total
            return (spec.max_concurrency, kv_pool(spec.kv_capacity_tokens, oc),
                    busy + max(s, len(waiting)), be.kv_in_use + max(k, sum(waiting)), 0, busy, be.kv_in_use)
        return {spec.name: one}
    eps = be.endpoints

    def endpoint(key: str, name: str) -> Callable[[], tuple[int, ...]]:
        def get() -> tuple[int, ...]:
            st = eps.by_key.get(key)
            if st is None:  # forgotten since: give the lease back
                return (0, 0, 0, 0, 1, 0, 0)
            s, k = leases.short.pop(name, (0, 0))
            pool_s, pool_k = st.spec.max_concurrency, kv_pool(st.spec.kv_capacity_tokens, oc)
            if st.draining:  # leaving the pool: keep what its requests in flight hold, no more
                return (pool_s, pool_k, st.in_flight, st.kv_in_use, 1, st.in_flight, st.kv_in_use)
            waiting = [kv for _, kv in be.waiting()]
            ps, pk = eps.plan(waiting, clock()).get(key, (0, 0)) if waiting else (0, 0)
            return (pool_s, pool_k, st.in_flight + max(s, ps), st.kv_in_use + max(k, pk), 0, st.in_flight,
                    st.kv_in_use)
        return get

    names = {key: endpoint_lease(spec.name, key) for key in eps.by_key}
    return {name: endpoint(key, name) for key, name in names.items()}


def place_leases(be: BackendState, leases: SlotLeases) -> None:
    """Give each endpoint of a pool this replica's lease on it and what the others hold there."""
    if be.endpoints is None:
        return
    for key, st in be.endpoints.by_key.items():
        ls = leases.leases.get(endpoint_lease(be.spec.name, key))
        if ls is None:
            st.leased_slots, st.leased_kv, st.others_slots, st.others_kv = 0, 0, 0, 0
        else:
            st.leased_slots, st.leased_kv, st.others_slots, st.others_kv = ls.slots, ls.kv, ls.others, ls.others_kv


def on_short(leases: SlotLeases, be: BackendState, kv: int, now: float) -> None:
    """An acquire of footprint ``kv`` was refused: if a lease is what was short, ask for more now."""
    asked = False
    if be.endpoints is None:
        name = be.spec.name
        ls = leases.leases.get(name)
        slots, lkv = (0, 0) if ls is None else (ls.slots, ls.kv)
        if be.pool.in_use().total >= slots or (be.spec.kv_capacity_tokens is not None and be.kv_in_use + kv > lkv):
            leases.want_more(name, 1, kv)
            asked = True
    else:
        for key, (s, k) in be.endpoints.plan([kv], now).items():
            st = be.endpoints.by_key[key]
            if st.leased_slots is None or st.in_flight >= st.leased_slots or (
                    st.spec.kv_capacity_tokens is not None and st.kv_in_use + kv > st.leased_kv):
                leases.want_more(endpoint_lease(be.spec.name, key), s, k)
                asked = True
    if asked:
        leases.poke()
