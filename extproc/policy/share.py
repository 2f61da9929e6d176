"""One worker's local share of the limits that are kept in each process.

With a shared store (Redis) a tenant's TPM and RPM hold across every process, and a
backend's slots and KV reservations are leased from it (``extproc.store.slot_leases``),
but a tenant's concurrency cap is still counted in each process (the README says why
it is not leased). ``extproc serve --workers N`` therefore gives each worker
``floor(cap / N)`` of it (and, for a store without leases, of the slots and KV): N
workers together never hold more than the limit (they may hold less: up to N - 1
slots stay unused, and a worker whose share rounds to 0 admits nothing there).

Pure: a policy in, a policy out.
"""

from __future__ import annotations

from dataclasses import replace

from extproc.policy.model import Backend, Policy, Tenant, Tier

__all__ = ["leased_view", "local_share", "zero_shares"]


def _part(value: int, n: int) -> int:
    return value // n


def _backend(b: Backend, n: int) -> Backend:
    kv = None if b.kv_capacity_tokens is None else _part(b.kv_capacity_tokens, n)
    return replace(b, max_concurrency=_part(b.max_concurrency, n), kv_capacity_tokens=kv)


def _tier(t: Tier, n: int) -> Tier:
    burst = None if t.burst_slots is None else _part(t.burst_slots, n)
    return replace(t, max_concurrency=_part(t.max_concurrency, n), guaranteed_slots=_part(t.guaranteed_slots, n),
                   burst_slots=burst)


def _tenant(t: Tenant, n: int) -> Tenant:
    return t if t.max_concurrency is None else replace(t, max_concurrency=_part(t.max_concurrency, n))


def local_share(policy: Policy, n: int, pools: bool = True) -> Policy:
    """``policy`` with each per-process limit cut to ``floor(limit / n)``; unchanged for n = 1.

    Cut: a backend's ``max_concurrency`` and ``kv_capacity_tokens``, a tier's
    ``max_concurrency``, ``guaranteed_slots`` and ``burst_slots``, a tenant's
    ``max_concurrency``. Not cut: TPM and RPM (kept in the shared store) and queue
    depths (a queue holds no capacity). The sum of the tiers' guarantees stays within
    the backend's slots: ``sum(floor(g / n)) <= floor(sum(g) / n) <= floor(total / n)``.
    ``pools=False`` leaves backends' slots and KV (and the tiers' guarantees) alone: for
    a store that leases them (``extproc.store.slot_leases``).
    """
    if n < 1:
        raise ValueError(f"a share of {n} processes")
    if n == 1:
        return policy
    if not pools:
        return replace(policy, tiers={name: replace(t, max_concurrency=_part(t.max_concurrency, n))
                                      for name, t in policy.tiers.items()},
                       tenants={name: _tenant(t, n) for name, t in policy.tenants.items()}, _limits={})
    backends = tuple(_backend(b, n) for b in policy.backends)
    by_name = {b.name: b for b in backends}
    by_model = {m: (by_name[b.name], model) for m, (b, model) in policy.by_model.items()}
    return replace(policy, backends=backends, by_model=by_model,
                   tiers={name: _tier(t, n) for name, t in policy.tiers.items()},
                   tenants={name: _tenant(t, n) for name, t in policy.tenants.items()}, _limits={})


def zero_shares(policy: Policy) -> list[str]:
    """What a share made unusable (0 slots, 0 concurrent requests), for a warning at start."""
    out = [f"backend {b.name}: max_concurrency 0" for b in policy.backends if b.max_concurrency == 0]
    out += [f"tier {t.name}: max_concurrency 0" for t in policy.tiers.values() if t.max_concurrency == 0]
    out += [f"tenant {t.name}: max_concurrency 0" for t in policy.tenants.values() if t.max_concurrency == 0]
    return out


def leased_view(spec: Backend, policy: Policy, full: Policy, slots: int) -> tuple[Backend, Policy]:
    """A backend and the policy it is configured from when ``slots`` of its pool are leased.

    ``spec``'s ``max_concurrency`` becomes ``slots``; each tier's ``guaranteed_slots``
    and ``burst_slots`` on it are cut in proportion, ``floor(g × slots / pool)`` (from
    ``full``, the policy as written), so they fit the lease. KV is leased separately
    (``BackendState.kv_lease``).
    """
    pool = next((b.max_concurrency for b in full.backends if b.name == spec.name), spec.max_concurrency)

    def cut(x: int) -> int:
        return 0 if pool <= 0 else x * slots // pool

    tiers = {}
    for name, t in policy.tiers.items():
        f = full.tiers.get(name, t)
        tiers[name] = replace(t, guaranteed_slots=cut(f.guaranteed_slots),
                              burst_slots=None if f.burst_slots is None else cut(f.burst_slots))
    return replace(spec, max_concurrency=slots), replace(policy, tiers=tiers, _limits={})
