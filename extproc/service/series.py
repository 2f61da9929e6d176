"""Forget the Prometheus series of what left the policy: a removed backend, a drained endpoint.

A series names what it describes in its ``backend`` label: a backend (``sim``), one of
its model routes' breakers (``sim/model``) or a pool endpoint's scrape
(``sim@host:port``); per-endpoint series carry ``backend`` and ``endpoint``. Once the
thing is gone its last value would be exported forever (a drained endpoint still
"usable", a removed backend's KV frozen at 93 %), so the monitor calls
:meth:`SeriesPruner.maybe_prune` and every ``PRUNE_S`` the series nothing in the
runtime owns any more are removed (``remove`` on the metric). Pruning by what exists,
not by what changed, also catches a late write: a stream of a removed backend that
settles after its backend went records its TTFT once more, and the next pass removes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from extproc.runtime.metrics import Metrics

PRUNE_S = 2.0


def owned(backends: Mapping[str, Any]) -> tuple[set[str], set[tuple[str, str]]]:
    """What the runtime has now: ``backend`` label values, and (backend, endpoint) pairs."""
    labels: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    for name, be in backends.items():
        labels.add(name)
        labels.update(f"{name}/{model}" for model in be.route_breakers)
        if be.endpoints is not None:
            for key in be.endpoints.by_key:  # draining ones too, until they are forgotten
                labels.add(f"{name}@{key}")
                pairs.add((name, key))
    return labels, pairs


def prune(m: Metrics, labels: set[str], pairs: set[tuple[str, str]]) -> int:
    """Remove every series whose ``backend`` (or backend and ``endpoint``) is not owned;
    returns how many label sets went."""
    removed = 0
    for metric in vars(m).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        # prometheus_client keeps a metric's label names and children in these two
        # attributes (remove() takes the full label values; remove_by_labels is only in recent releases).
        names = tuple(getattr(metric, "_labelnames", ()))
        if "backend" not in names:
            continue
        for values in _stale(metric, names, labels, pairs):
            m.forget(metric, *values)
            removed += 1
    return removed


def _stale(metric: MetricWrapperBase, names: tuple[str, ...], labels: set[str],
           pairs: set[tuple[str, str]]) -> list[tuple[str, ...]]:
    # The children by label values: reading them costs microseconds, where collect()
    # renders every histogram bucket (~17 ms a pass for a few backends and tiers).
    children: dict[tuple[str, ...], Any] = getattr(metric, "_metrics", {})
    b = names.index("backend")
    # endpoint, and a re-pick's from/to endpoints (its to_endpoint may be "unknown": not an endpoint)
    ends = [names.index(n) for n in ("endpoint", "from_endpoint", "to_endpoint") if n in names]
    return [values for values in list(children)
            if values[b] not in labels or any((values[b], values[e]) not in pairs and values[e] != "unknown"
                                              for e in ends)]


class SeriesPruner:
    """Prunes at most every ``interval_s`` (the monitor's tick is 0.1 s; a pass collects every
    backend-labelled metric)."""

    def __init__(self, interval_s: float = PRUNE_S) -> None:
        self.interval_s = interval_s
        self.next_at: float | None = None

    def maybe_prune(self, m: Metrics, backends: Mapping[str, Any], now: float) -> int:
        if self.next_at is not None and now < self.next_at:
            return 0
        self.next_at = now + self.interval_s
        return prune(m, *owned(backends))
