"""The ``breakers`` section: manual breaker overrides, checked against the backends, their
models and their pool endpoints (a section parser beside those in ``schema_parse``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.policy.model import BreakerOverride
from extproc.policy.reader import Path, Reader

__all__ = ["breakers", "check_endpoint"]


def breakers(
    r: Reader,
    doc: Any,
    backends: Mapping[str, set[str]],
    endpoints: Mapping[str, list[str]] | None = None,
) -> tuple[BreakerOverride, ...]:
    """Manual overrides; ``backends`` maps each backend to the models it serves,
    ``endpoints`` each pool to its endpoints' ``host:port``."""
    if doc is None:
        return ()
    if not isinstance(doc, list):
        r.fail(("breakers",), "expected a list of manual breaker overrides")
        return ()
    out = []
    for i, item in enumerate(doc):
        path: Path = ("breakers", i)
        m = r.mapping(item, path, tuple(BreakerOverride.__dataclass_fields__))
        backend = r.get(m, path, "backend", str)
        if backend is not None and backend not in backends:
            r.fail((*path, "backend"), f"unknown backend {backend!r}")
        state = r.get(m, path, "state", str, choices=("open", "closed"))
        reason = r.get(m, path, "reason", str)
        if reason is not None and not reason.strip():
            r.fail((*path, "reason"), "a manual override needs a reason")
        until = r.get(m, path, "until", (int, float), None)
        model = r.get(m, path, "model", str, None)
        if model is not None and backend in backends and model not in backends[backend]:
            r.fail((*path, "model"), f"backend {backend!r} does not serve model {model!r}")
        endpoint = r.get(m, path, "endpoint", str, None)
        if endpoint is not None:
            check_endpoint(r, path, backend, endpoint, model, backends, endpoints or {})
        out.append(
            BreakerOverride(
                backend=backend or "",
                state=state or "open",
                reason=reason or "",
                until=float(until) if until is not None else None,
                by=r.get(m, path, "by", str, ""),
                at=r.get(m, path, "at", (int, float), None),
                model=model,
                endpoint=endpoint,
            )
        )
    return tuple(out)


def check_endpoint(
    r: Reader,
    path: Path,
    backend: str | None,
    endpoint: str,
    model: str | None,
    backends: Mapping[str, set[str]],
    endpoints: Mapping[str, list[str]],
) -> None:
    """An endpoint override names one endpoint of a pool; a model route has no endpoints of
    its own."""
    if model is not None:
        r.fail((*path, "endpoint"), "an override names a model route or a pool endpoint, not both")
    if backend is None or backend not in backends:
        return
    known = endpoints.get(backend) or []
    if not known:
        r.fail((*path, "endpoint"), f"backend {backend!r} is not a pool (it has no endpoints)")
    elif endpoint not in known:
        r.fail(
            (*path, "endpoint"),
            f"backend {backend!r} has no endpoint {endpoint!r} (its endpoints: {', '.join(known)})",
        )
