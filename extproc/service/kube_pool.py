"""``serve --inference-pool BACKEND=NAMESPACE/NAME``: a pool's endpoints from the cluster.

The official ``kubernetes`` client watches, each in a thread of its own (the client is
synchronous): the InferencePool, the pods of its namespace, and the InferenceObjectives there.
Each watch lists first (its resourceVersion), then watches from it, and lists again when the
stream ends or the version is too old (410). Every change wakes the event loop, which derives
the pool's ready endpoints (``extproc.backends.inference_pool``) and, when they changed, swaps
the policy with them (``Runtime.transforms``: a reload of the files or the console's keeps
them); endpoints that left drain as a policy edit's do. The static ``endpoints:`` of every
other backend stay as the policy says.

Readiness (the picker's ``readiness`` health service) is NOT_SERVING until the pool and its
pods have been listed once, as GIE's reference picker waits for its datastore to sync.

Pods are watched namespace-wide and matched against the pool's selector here, so a changed
selector needs no new watch (RBAC: ``get/list/watch`` on pods, inferencepools and
inferenceobjectives in the namespace; deploy/base/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from extproc.backends.inference_pool import objective_tiers, ready_addresses, with_endpoints
from extproc.policy.schema import Policy
from extproc.runtime.runtime import Runtime

log = logging.getLogger("sluice.kube")

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL = "llm-d.ai", "v1alpha2", "inferenceobjectives"
WATCH_TIMEOUT_S = 300  # the server ends each watch after this; it is then resumed
RETRY_S = 2.0


@dataclass(frozen=True)
class PoolRef:
    backend: str
    namespace: str
    name: str

    @classmethod
    def parse(cls, value: str, default_namespace: str = "default") -> PoolRef:
        """``BACKEND=NAMESPACE/NAME`` or ``BACKEND=NAME`` (the default namespace)."""
        backend, eq, ref = value.partition("=")
        if not eq or not backend or not ref:
            raise ValueError(f"--inference-pool wants BACKEND=[NAMESPACE/]NAME, not {value!r}")
        ns, _, name = ref.rpartition("/")
        return cls(backend, ns or default_namespace, name)


class Cache:
    """One resource kind's objects by name, kept by a list-then-watch loop in a thread."""

    def __init__(self, kind: str, list_fn: Callable[..., Any], to_dict: Callable[[Any], dict[str, Any]],
                 changed: Callable[[], None], **kwargs: Any) -> None:
        self.kind, self.list_fn, self.to_dict, self.changed, self.kwargs = kind, list_fn, to_dict, changed, kwargs
        self.objects: dict[str, dict[str, Any]] = {}
        self.synced = threading.Event()
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.objects.values())

    def run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self.stopping.is_set():
            try:
                listed = self.to_dict(self.list_fn(**self.kwargs))
                with self.lock:
                    self.objects = {o["metadata"]["name"]: o for o in listed.get("items") or ()}
                self.synced.set()
                self.changed()
                version = (listed.get("metadata") or {}).get("resourceVersion")
                w = watch.Watch()
                for event in w.stream(self.list_fn, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                                      **self.kwargs):
                    if self.stopping.is_set():
                        w.stop()
                        return
                    obj = event["object"]
                    obj = obj if isinstance(obj, dict) else self.to_dict(obj)
                    name = (obj.get("metadata") or {}).get("name")
                    if event["type"] == "ERROR" or name is None:
                        break  # e.g. 410 Gone: list again
                    with self.lock:
                        if event["type"] == "DELETED":
                            self.objects.pop(name, None)
                        else:
                            self.objects[name] = obj
                    self.changed()
            except ApiException as exc:
                if exc.status == 404 and self.kind == "inferenceobjectives":
                    log.info("no InferenceObjective API in the cluster; objectives are not read")
                    self.synced.set()
                    return
                log.warning("watching %s: %s; again in %.0f s", self.kind, exc.reason, RETRY_S)
                self.stopping.wait(RETRY_S)
            except Exception as exc:  # noqa: BLE001 - a dropped connection, a parse error: list again
                log.warning("watching %s: %s; again in %.0f s", self.kind, exc, RETRY_S)
                self.stopping.wait(RETRY_S)


class ClusterPool:
    """Keeps one backend's endpoints equal to its InferencePool's ready pods."""

    def __init__(self, runtime: Runtime, ref: PoolRef, api_client: Any, on_ready: Callable[[], None]) -> None:
        from kubernetes import client

        self.rt, self.ref, self.on_ready = runtime, ref, on_ready
        self.loop = asyncio.get_running_loop()
        self.addresses: tuple[str, ...] | None = None
        self.objectives: dict[str, str] = {}
        self._pending = False
        self.ready = False
        core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
        to_dict = api_client.sanitize_for_serialization
        self.pools = Cache("inferencepools", custom.list_namespaced_custom_object, to_dict, self._wake,
                           group=POOL_GROUP, version=POOL_VERSION, namespace=ref.namespace, plural=POOL_PLURAL,
                           field_selector=f"metadata.name={ref.name}")
        self.pods = Cache("pods", core.list_namespaced_pod, to_dict, self._wake, namespace=ref.namespace)
        self.objective_cache = Cache("inferenceobjectives", custom.list_namespaced_custom_object, to_dict,
                                     self._wake, group=OBJECTIVE_GROUP, version=OBJECTIVE_VERSION,
                                     namespace=ref.namespace, plural=OBJECTIVE_PLURAL)
        self.caches = (self.pools, self.pods, self.objective_cache)
        runtime.transforms.append(self.transform)

    def start(self) -> None:
        for c in self.caches:
            threading.Thread(target=c.run, name=f"kube-{c.kind}", daemon=True).start()

    def stop(self) -> None:
        for c in self.caches:
            c.stopping.set()

    def objective_tier(self, name: str) -> str | None:
        return self.objectives.get(name)

    # -- on the event loop ------------------------------------------------------------
    def _wake(self) -> None:
        """From a watch thread: look again, once per burst of events."""
        if not self._pending:
            self._pending = True
            self.loop.call_soon_threadsafe(self._refresh)

    def _refresh(self) -> None:
        self._pending = False
        if not (self.pools.synced.is_set() and self.pods.synced.is_set()):
            return
        pool = next(iter(self.pools.snapshot()), None)
        addresses = ready_addresses(pool, self.pods.snapshot()) if pool is not None else ()
        self.objectives = objective_tiers(self.objective_cache.snapshot(), self.ref.name, self.rt.full_policy)
        if addresses != self.addresses:
            log.info("pool %s/%s: %d ready endpoints %s", self.ref.namespace, self.ref.name, len(addresses),
                     ", ".join(addresses))
            self.addresses = addresses
            self.rt.swap(self.rt.full_policy, self.rt.etag)
        if not self.ready:
            self.ready = True
            self.on_ready()

    def transform(self, policy: Policy) -> Policy:
        if not self.addresses:
            return policy
        backends = tuple(with_endpoints(b, self.addresses) if b.name == self.ref.backend else b
                         for b in policy.backends)
        if backends == policy.backends:
            return policy
        by_name = {b.name: b for b in backends}  # as extproc.policy.share rebuilds a policy
        by_model = {m: (by_name[b.name], model) for m, (b, model) in policy.by_model.items()}
        return replace(policy, backends=backends, by_model=by_model)


def api_client(kubeconfig: str | None) -> Any:
    """In the cluster: the pod's service account; elsewhere ``--kubeconfig`` or $KUBECONFIG."""
    from kubernetes import client, config

    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            pass
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)
