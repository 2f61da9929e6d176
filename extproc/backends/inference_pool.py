"""A pool's endpoints from the cluster: an InferencePool and its pods, as Kubernetes reports them.

Pure: objects in (dicts, as the API server's JSON), endpoints out. The watching is
``extproc.service.kube_pool``'s.

* ``ready_addresses``: the pool's members are the pods of its namespace that match its
  ``spec.selector.matchLabels``, are Running and Ready, have a pod IP and are not being
  deleted; each is an endpoint per ``spec.targetPorts`` number (``ip:port``), as GIE's
  reference picker reads them.
* ``with_endpoints``: the policy's backend with those endpoints. Each discovered endpoint takes
  its budgets (``kv_capacity_tokens``, ``max_concurrency``) and its metrics path from the
  first endpoint the policy lists for the pool (the template); the metrics port is the
  template's when it differs from the template's serving port, else the target port. The
  pool's totals are derived as the policy's are (``pool_totals``).
* ``objective_tiers``: InferenceObjectives (``spec.priority``, ``spec.poolRef``) onto Sluice's
  tiers. A negative priority is GIE's "sheddable": such a request is admitted in the policy's
  lowest-priority tier. Zero and positive priorities leave the tenant's own tier: the
  objective is named by a request header, and a client must not promote itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from extproc.policy.schema import Backend, Endpoint, Policy
from extproc.policy.schema_backends import pool_totals

# The request headers that name an InferenceObjective (llm-d-router's, then GIE's older one).
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")


def _ready(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def selects(pool: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    want = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(want) and all(labels.get(k) == v for k, v in want.items())


def ready_addresses(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """``ip:port`` of every ready member of the pool, sorted."""
    ports = [p.get("number") for p in (pool.get("spec") or {}).get("targetPorts") or ()]
    out = {f"{pod['status']['podIP']}:{port}" for pod in pods if selects(pool, pod) and _ready(pod)
           for port in ports if isinstance(port, int)}
    return tuple(sorted(out))


def _endpoint(template: Endpoint, address: str) -> Endpoint:
    host, _, port_s = address.rpartition(":")
    port = int(port_s)
    url = template.metrics_url
    if url is not None:
        parts = urlsplit(url)
        metrics_port = parts.port if parts.port is not None and parts.port != template.port else port
        url = urlunsplit((parts.scheme, f"{host}:{metrics_port}", parts.path, parts.query, parts.fragment))
    return replace(template, host=host, port=port, metrics_url=url)


def with_endpoints(spec: Backend, addresses: Iterable[str]) -> Backend:
    """The backend with ``addresses`` as its endpoints (the template's budgets). With none the
    backend is returned as it was: the endpoints it last had stay until their scrapes and
    breakers find them gone (unusable: 503), instead of the pool turning into one address."""
    addrs = list(addresses)
    if not spec.endpoints or not addrs:
        return spec
    template = spec.endpoints[0]
    endpoints = tuple(_endpoint(template, a) for a in addrs)
    host, port, max_concurrency, kv = pool_totals(endpoints)
    return replace(spec, endpoints=endpoints, host=host, port=port, max_concurrency=max_concurrency,
                   kv_capacity_tokens=kv)


def objective_tiers(objectives: Iterable[Mapping[str, Any]], pool: str, policy: Policy) -> dict[str, str]:
    """Objective name -> the tier its requests are admitted in (only the sheddable ones)."""
    if not policy.tiers:
        return {}
    lowest = min(policy.tiers.values(), key=lambda t: (t.priority, t.name)).name
    out = {}
    for o in objectives:
        spec = o.get("spec") or {}
        if (spec.get("poolRef") or {}).get("name") != pool:
            continue
        priority = spec.get("priority")
        if isinstance(priority, int) and priority < 0:
            out[(o.get("metadata") or {}).get("name", "")] = lowest
    return out
