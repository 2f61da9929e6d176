"""The policy schema: plain data in, a validated, immutable ``Policy`` out.

Pure: no file access. ``policyfile`` turns YAML files into the plain document and a
map from document paths to ``file:line`` so every error points at what to fix. The
console imports this module (and only this one) to validate operator edits.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Path = tuple[str | int, ...]
Locator = Callable[[Path], str]

KNOWN_ENCODINGS = ("cl100k_base", "o200k_base")
SECTIONS = ("gateway", "backends", "tiers", "tenants")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(api_key: str) -> str:
    """The form in which the policy stores an API key."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Gateway:
    max_body_bytes: int = 1 << 20
    unknown_paths: str = "reject"  # or "passthrough"
    strip_api_key: bool = True
    default_max_tokens: int = 1024
    failure_mode_allow: bool = False
    message_timeout_ms: int = 5000
    image_token_estimate: int = 765


@dataclass(frozen=True)
class Model:
    name: str
    context_window: int
    encoding: str = "cl100k_base"
    default_max_tokens: int | None = None


@dataclass(frozen=True)
class Backend:
    name: str
    host: str
    port: int
    max_concurrency: int
    models: tuple[Model, ...]
    metrics_url: str | None = None


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    tpm: int
    rpm: int
    burst_tokens: int  # bucket capacity; defaults to one minute's worth
    max_concurrency: int  # per tenant
    guaranteed_slots: int = 0  # per backend, reserved for this tier
    max_queue_wait_ms: int = 0
    max_queue_depth: int = 0
    queue_weight: int = 1


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str
    key_hashes: tuple[str, ...]
    tpm: int | None = None
    rpm: int | None = None
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits: its tier's, with the tenant's overrides."""

    tpm: int
    rpm: int
    burst_tokens: int
    max_concurrency: int


@dataclass(frozen=True)
class Policy:
    gateway: Gateway
    backends: tuple[Backend, ...]
    tiers: Mapping[str, Tier]
    tenants: Mapping[str, Tenant]
    by_key: Mapping[str, str] = field(repr=False)  # key hash -> tenant name
    by_model: Mapping[str, tuple[Backend, Model]] = field(repr=False)

    def limits(self, tenant: Tenant) -> Limits:
        tier = self.tiers[tenant.tier]
        tpm = tenant.tpm if tenant.tpm is not None else tier.tpm
        burst = tier.burst_tokens if tenant.tpm is None else max(tpm, tier.burst_tokens * tpm // max(tier.tpm, 1))
        return Limits(
            tpm=tpm,
            rpm=tenant.rpm if tenant.rpm is not None else tier.rpm,
            burst_tokens=burst,
            max_concurrency=tenant.max_concurrency if tenant.max_concurrency is not None else tier.max_concurrency,
        )

    def tenant_for_key(self, api_key: str) -> Tenant | None:
        name = self.by_key.get(hash_key(api_key))
        return self.tenants[name] if name is not None else None


@dataclass(frozen=True)
class Problem:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class PolicyError(ValueError):
    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "<root>"


class _Reader:
    """Walks the document collecting every problem, not just the first."""

    def __init__(self, locate: Locator):
        self.locate = locate
        self.problems: list[Problem] = []

    def fail(self, path: Path, message: str) -> None:
        self.problems.append(Problem(self.locate(path), f"{_dotted(path)}: {message}"))

    def mapping(self, value: Any, path: Path, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in allowed:
                self.fail((*path, str(key)), f"unknown field (allowed: {', '.join(allowed)})")
        return value

    def get(self, m: Mapping[str, Any], path: Path, key: str, kind: type | tuple[type, ...],
            default: Any = ..., *, minimum: float | None = None, choices: tuple[Any, ...] = ()) -> Any:
        p = (*path, key)
        if key not in m or m[key] is None:
            if default is ...:
                self.fail(p, "required field is missing")
                return None
            return default
        v = m[key]
        # bool is an int in Python; a policy saying `tpm: true` is a mistake.
        if isinstance(v, bool) and kind is not bool:
            self.fail(p, f"expected {getattr(kind, '__name__', kind)}, got a boolean")
            return None if default is ... else default
        if not isinstance(v, kind):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(p, f"expected {want}, got {type(v).__name__}")
            return None if default is ... else default
        if minimum is not None and v < minimum:
            self.fail(p, f"must be >= {minimum}, got {v}")
        if choices and v not in choices:
            self.fail(p, f"must be one of {', '.join(map(str, choices))}, got {v!r}")
        return v

    def name(self, m: Mapping[str, Any], path: Path, key: str = "name") -> str | None:
        v = self.get(m, path, key, str)
        if v is not None and not _NAME.match(v):
            self.fail((*path, key), f"{v!r} is not a valid name (lowercase letters, digits, _ . -)")
        return v


def _gateway(r: _Reader, doc: Any) -> Gateway:
    path: Path = ("gateway",)
    m = r.mapping(doc if doc is not None else {}, path, tuple(Gateway.__dataclass_fields__))
    d = Gateway()
    return Gateway(
        max_body_bytes=r.get(m, path, "max_body_bytes", int, d.max_body_bytes, minimum=1024),
        unknown_paths=r.get(m, path, "unknown_paths", str, d.unknown_paths, choices=("reject", "passthrough")),
        strip_api_key=r.get(m, path, "strip_api_key", bool, d.strip_api_key),
        default_max_tokens=r.get(m, path, "default_max_tokens", int, d.default_max_tokens, minimum=1),
        failure_mode_allow=r.get(m, path, "failure_mode_allow", bool, d.failure_mode_allow),
        message_timeout_ms=r.get(m, path, "message_timeout_ms", int, d.message_timeout_ms, minimum=100),
        image_token_estimate=r.get(m, path, "image_token_estimate", int, d.image_token_estimate, minimum=0),
    )


def _backends(r: _Reader, doc: Any) -> tuple[Backend, ...]:
    if not isinstance(doc, list) or not doc:
        r.fail(("backends",), "expected a non-empty list of backends")
        return ()
    out = []
    for i, item in enumerate(doc):
        path: Path = ("backends", i)
        m = r.mapping(item, path, ("name", "address", "max_concurrency", "models", "metrics_url"))
        name = r.name(m, path)
        address = r.get(m, path, "address", str)
        host, port = "", 0
        if address is not None:
            host, _, port_s = address.rpartition(":")
            if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
                r.fail((*path, "address"), f"expected host:port, got {address!r}")
            else:
                port = int(port_s)
        models = []
        raw_models = m.get("models")
        if not isinstance(raw_models, list) or not raw_models:
            r.fail((*path, "models"), "expected a non-empty list of models")
            raw_models = []
        for j, mm in enumerate(raw_models):
            mp: Path = (*path, "models", j)
            mmap = r.mapping(mm, mp, tuple(Model.__dataclass_fields__))
            mname = r.get(mmap, mp, "name", str)
            models.append(Model(
                name=mname or "",
                context_window=r.get(mmap, mp, "context_window", int, minimum=16) or 0,
                encoding=r.get(mmap, mp, "encoding", str, "cl100k_base", choices=KNOWN_ENCODINGS),
                default_max_tokens=r.get(mmap, mp, "default_max_tokens", int, None, minimum=1),
            ))
        out.append(Backend(
            name=name or "", host=host, port=port,
            max_concurrency=r.get(m, path, "max_concurrency", int, 64, minimum=1),
            models=tuple(models),
            metrics_url=r.get(m, path, "metrics_url", str, None),
        ))
    return tuple(out)


def _tiers(r: _Reader, doc: Any) -> dict[str, Tier]:
    fields = tuple(f for f in Tier.__dataclass_fields__ if f != "name")
    m = r.mapping(doc, ("tiers",), tuple(doc)) if isinstance(doc, dict) else r.mapping(doc, ("tiers",), ())
    out: dict[str, Tier] = {}
    for name, item in m.items():
        path: Path = ("tiers", name)
        if not _NAME.match(str(name)):
            r.fail(path, f"{name!r} is not a valid tier name")
        t = r.mapping(item, path, fields)
        tpm = r.get(t, path, "tpm", int, minimum=1) or 1
        out[str(name)] = Tier(
            name=str(name),
            priority=r.get(t, path, "priority", int, 0),
            tpm=tpm,
            rpm=r.get(t, path, "rpm", int, minimum=1) or 1,
            burst_tokens=r.get(t, path, "burst_tokens", int, tpm, minimum=1),
            max_concurrency=r.get(t, path, "max_concurrency", int, 1 << 20, minimum=1),
            guaranteed_slots=r.get(t, path, "guaranteed_slots", int, 0, minimum=0),
            max_queue_wait_ms=r.get(t, path, "max_queue_wait_ms", int, 0, minimum=0),
            max_queue_depth=r.get(t, path, "max_queue_depth", int, 0, minimum=0),
            queue_weight=r.get(t, path, "queue_weight", int, 1, minimum=1),
        )
    if not out:
        r.fail(("tiers",), "at least one tier is required")
    return out


def _tenants(r: _Reader, doc: Any, tiers: Mapping[str, Tier]) -> tuple[dict[str, Tenant], dict[str, str]]:
    """The tenants by name, and key hash -> tenant name."""
    by_key: dict[str, str] = {}
    if not isinstance(doc, list):
        r.fail(("tenants",), "expected a list of tenants")
        return {}, by_key
    out: dict[str, Tenant] = {}
    for i, item in enumerate(doc):
        path: Path = ("tenants", i)
        m = r.mapping(item, path, ("name", "tier", "keys", "tpm", "rpm", "max_concurrency"))
        name = r.name(m, path)
        tier = r.get(m, path, "tier", str)
        if tier is not None and tier not in tiers:
            r.fail((*path, "tier"), f"unknown tier {tier!r} (known: {', '.join(sorted(tiers))})")
        keys = m.get("keys")
        hashes: list[str] = []
        if not isinstance(keys, list) or not keys:
            r.fail((*path, "keys"), "expected a non-empty list of key hashes (sha256:<hex>)")
        else:
            for j, k in enumerate(keys):
                if not isinstance(k, str) or not k.startswith("sha256:") or not _HEX64.match(k[7:]):
                    r.fail((*path, "keys", j), "expected sha256:<64 lowercase hex>; store hashes, never keys")
                    continue
                hashes.append(k)
                # Checked here, where i and j still point at the list items in the file.
                if k in by_key and by_key[k] != name:
                    r.fail((*path, "keys", j), f"key already belongs to tenant {by_key[k]!r}")
                by_key.setdefault(k, name or "")
        tenant = Tenant(
            name=name or "", tier=tier or "", key_hashes=tuple(hashes),
            tpm=r.get(m, path, "tpm", int, None, minimum=1),
            rpm=r.get(m, path, "rpm", int, None, minimum=1),
            max_concurrency=r.get(m, path, "max_concurrency", int, None, minimum=1),
        )
        if name in out:
            r.fail((*path, "name"), f"duplicate tenant {name!r}")
        else:
            out[name or f"#{i}"] = tenant
    return out, by_key


def build_policy(doc: Mapping[str, Any], locate: Locator | None = None) -> Policy:
    """Validate a plain policy document; raise ``PolicyError`` listing every problem."""
    r = _Reader(locate or (lambda path: "<policy>"))
    for key in doc:
        if key not in SECTIONS:
            r.fail((str(key),), f"unknown section (known: {', '.join(SECTIONS)})")
    gateway = _gateway(r, doc.get("gateway"))
    backends = _backends(r, doc.get("backends"))
    tiers = _tiers(r, doc.get("tiers", {}))
    tenants, by_key = _tenants(r, doc.get("tenants", []), tiers)

    by_model: dict[str, tuple[Backend, Model]] = {}
    seen_backends: set[str] = set()
    for i, b in enumerate(backends):
        if b.name in seen_backends:
            r.fail(("backends", i, "name"), f"duplicate backend {b.name!r}")
        seen_backends.add(b.name)
        guaranteed = sum(t.guaranteed_slots for t in tiers.values())
        if guaranteed > b.max_concurrency:
            r.fail(("backends", i, "max_concurrency"),
                   f"tiers guarantee {guaranteed} slots, more than this backend's {b.max_concurrency}")
        for j, mdl in enumerate(b.models):
            if mdl.name in by_model:
                r.fail(("backends", i, "models", j, "name"),
                       f"model {mdl.name!r} is already served by backend {by_model[mdl.name][0].name!r}")
            by_model[mdl.name] = (b, mdl)
    if r.problems:
        raise PolicyError(r.problems)
    return Policy(gateway=gateway, backends=backends, tiers=tiers, tenants=tenants,
                  by_key=by_key, by_model=by_model)
