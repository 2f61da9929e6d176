"""Operator overrides layered over the base document. Pure: documents in, documents out.

An override names one field of one tenant or tier (or a backend's manual breaker)
and remembers what the base said when it was made, so a later change of the files
can be told apart from the operator's intent:

- the target is gone from the files          -> conflict "missing", not applied
- the base value changed since the edit      -> conflict "changed", still applied
- the edit no longer validates with the rest -> conflict "invalid", not applied
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from extproc.policy import schema

TENANT_FIELDS = ("tier", "tpm", "rpm", "max_concurrency")
BREAKER_FIELD = "manual"


def breaker_field(endpoint: str | None = None) -> str:
    """The override's field: ``manual`` for a backend's breaker, ``manual@host:port`` for
    one endpoint's of a pool (each endpoint's trip is its own override)."""
    return BREAKER_FIELD if endpoint is None else f"{BREAKER_FIELD}@{endpoint}"


def endpoint_addresses(backend: dict[str, Any]) -> list[str]:
    """A pool's endpoints as the files list them (``address`` is the endpoint's ``host:port``)."""
    raw = backend.get("endpoints")
    return [str(e["address"]) for e in raw if isinstance(e, dict) and isinstance(e.get("address"), str)] \
        if isinstance(raw, list) else []


def tier_fields() -> tuple[str, ...]:
    """The tier's fields as the schema defines them today."""
    return tuple(f for f in schema.Tier.__dataclass_fields__ if f != "name")


def _number_kind(hint: Any) -> str | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) == 1 and args[0] in (int, float) and args[0] is not bool:
        return "int" if args[0] is int else "float"
    return None


def editable_tier_fields() -> dict[str, str]:
    """Dotted field -> "int" | "float": the numbers a form can edit, nested ones included
    (``degrade.shed_below_scale``). Lists such as ``shadow`` are shown, not edited."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(schema.Tier)
    for name in tier_fields():
        kind = _number_kind(hints[name])
        if kind:
            out[name] = kind
        elif dataclasses.is_dataclass(hints[name]):
            for sub, sub_hint in typing.get_type_hints(hints[name]).items():
                sub_kind = _number_kind(sub_hint)
                if sub_kind:
                    out[f"{name}.{sub}"] = sub_kind
    return out


@dataclass(frozen=True)
class Override:
    id: int
    scope: str  # tenant | tier | breaker | tenant_new | key
    target: str  # the tenant, tier or backend
    field: str  # the field; for "key" the key's hash; "" for "tenant_new"
    value: Any  # None removes the field (the key)
    base_value: Any
    actor: str
    at: float
    reason: str


@dataclass(frozen=True)
class Conflict:
    override: Override
    kind: str  # missing | changed | invalid
    message: str
    base_now: Any = None


@dataclass
class Applied:
    doc: dict[str, Any]
    applied: list[Override] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    next_expiry: float | None = None


def entity(doc: dict[str, Any], scope: str, target: str) -> dict[str, Any] | None:
    if scope == "tenant":
        for item in doc.get("tenants") or []:
            if isinstance(item, dict) and item.get("name") == target:
                return item
        return None
    if scope == "tier":
        tiers = doc.get("tiers")
        item = tiers.get(target) if isinstance(tiers, dict) else None
        return item if isinstance(item, dict) else None
    if scope == "breaker":
        for item in doc.get("backends") or []:
            if isinstance(item, dict) and item.get("name") == target:
                return item
    return None


def base_value(doc: dict[str, Any], scope: str, target: str, name: str) -> Any:
    found = entity(doc, scope, target)
    return get_field(found, name) if found is not None else None


def get_field(item: dict[str, Any], name: str) -> Any:
    """``name`` may be dotted: ``degrade.clamp_max_tokens``."""
    value: Any = item
    for part in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def set_field(item: dict[str, Any], name: str, value: Any) -> None:
    """Set (or with ``None`` remove) a possibly dotted field; emptied parents go too."""
    *parents, last = name.split(".")
    chain = [item]
    for part in parents:
        nxt = chain[-1].get(part)
        if not isinstance(nxt, dict):
            if value is None:
                return
            nxt = chain[-1][part] = {}
        chain.append(nxt)
    if value is None:
        chain[-1].pop(last, None)
        for parent, part in zip(reversed(chain[:-1]), reversed(parents), strict=True):
            if parent.get(part) == {}:
                del parent[part]
    else:
        chain[-1][last] = value


def new_tenant(value: Any) -> dict[str, Any]:
    """The item a "tenant_new" override adds: its name and tier; keys come from "key" overrides."""
    v = value if isinstance(value, dict) else {}
    return {"name": v.get("name"), "tier": v.get("tier"), "keys": []}


def apply_one(doc: dict[str, Any], base: dict[str, Any], ov: Override) -> Conflict | None:
    """Apply one tenant, tier, tenant_new or key override to ``doc`` in place.

    A "missing" conflict means nothing was applied; a "changed" one was still applied.
    A console-created tenant the files now define, a key the files already hold (or no
    longer hold, for a removal) apply as no-ops: the files caught up with the console.
    """
    if ov.scope == "tenant_new":
        if entity(doc, "tenant", ov.target) is None:
            if not isinstance(doc.get("tenants"), list):
                doc["tenants"] = []
            doc["tenants"].append(new_tenant(ov.value))
        return None
    target = entity(doc, "tenant" if ov.scope == "key" else ov.scope, ov.target)
    if target is None:
        what = "tenant" if ov.scope == "key" else ov.scope
        return Conflict(ov, "missing", f"{what} {ov.target!r} is no longer in the policy files")
    if ov.scope == "key":
        keys = target.get("keys") if isinstance(target.get("keys"), list) else []
        if ov.value is None:
            target["keys"] = [k for k in keys if k != ov.field]
        elif ov.field not in keys:
            target["keys"] = [*keys, ov.field]
        return None
    conflict = None
    now_base = base_value(base, ov.scope, ov.target, ov.field)
    if now_base != ov.base_value and now_base != ov.value:
        conflict = Conflict(
            ov, "changed",
            f"the files changed {ov.target}.{ov.field} from {_show(ov.base_value)} to {_show(now_base)} "
            f"after this override set it to {_show(ov.value)}", now_base)
    set_field(target, ov.field, ov.value)
    return conflict


def _groups(fields: list[Override]) -> list[list[Override]]:
    """Overrides that only make sense together: a created tenant and the keys issued with
    it (a tenant without keys does not validate). Everything else stands alone."""
    groups: list[list[Override]] = []
    created: dict[str, list[Override]] = {}
    for ov in fields:
        if ov.scope == "key" and ov.target in created and ov.value is not None:
            created[ov.target].append(ov)
            continue
        group = [ov]
        if ov.scope == "tenant_new":
            created[ov.target] = group
        groups.append(group)
    return groups


def apply(base: dict[str, Any], overrides: Iterable[Override], now: float,
          check: Callable[[dict[str, Any]], list[str]]) -> Applied:
    """The effective document: ``base`` with every override that still applies.

    ``check`` returns the problems of a document (empty when valid). It is called
    once when everything applies cleanly, and per override (or group) only when not.
    """
    doc = copy.deepcopy(base)
    out = Applied(doc)
    breakers: list[dict[str, Any]] = []
    fields: list[Override] = []
    for ov in overrides:
        if ov.scope == "breaker":
            _apply_breaker(doc, ov, now, breakers, out)
            continue
        conflict = apply_one(doc, base, ov)
        if conflict is not None:
            out.conflicts.append(conflict)
        if conflict is None or conflict.kind == "changed":
            fields.append(ov)
    if fields and check(doc):
        # Something no longer fits: rebuild one override at a time and keep those that do.
        doc = copy.deepcopy(base)
        for group in _groups(fields):
            trial = copy.deepcopy(doc)
            missing = [c for c in (apply_one(trial, base, ov) for ov in group) if c and c.kind == "missing"]
            if missing:
                out.conflicts.extend(missing)
                continue
            found = check(trial)
            if found:
                out.conflicts.extend(Conflict(ov, "invalid", "no longer valid: " + "; ".join(found)) for ov in group)
            else:
                doc = trial
                out.applied.extend(group)
        out.doc = doc
    else:
        out.applied.extend(fields)
    # Entries written in the files stay unless the console has its own for that backend
    # (or, for an endpoint's entry, for that endpoint).
    mine = {_breaker_key(b) for b in breakers}
    from_files = [b for b in base.get("breakers") or [] if not (isinstance(b, dict) and _breaker_key(b) in mine)]
    doc["breakers"] = copy.deepcopy(from_files) + sorted(breakers, key=lambda b: tuple(map(str, _breaker_key(b))))
    out.applied.sort(key=lambda o: (o.at, o.id))
    return out


def _apply_breaker(doc: dict[str, Any], ov: Override, now: float, breakers: list[dict[str, Any]],
                   out: Applied) -> None:
    backend = entity(doc, "breaker", ov.target)
    if backend is None:
        out.conflicts.append(Conflict(ov, "missing", f"backend {ov.target!r} is no longer in the policy files"))
        return
    entry = dict(ov.value or {})
    endpoint = entry.get("endpoint")
    if endpoint is not None and endpoint not in endpoint_addresses(backend):
        out.conflicts.append(Conflict(ov, "missing", f"endpoint {endpoint!r} of backend {ov.target!r} is no "
                                                     "longer in the policy files"))
        return
    until = entry.get("until")
    if until is not None:
        if until <= now:
            return  # expired: no longer part of the policy, nothing to resolve
        out.next_expiry = until if out.next_expiry is None else min(out.next_expiry, until)
    breakers.append(entry)
    out.applied.append(ov)


def _breaker_key(entry: dict[str, Any]) -> tuple[Any, Any]:
    return entry.get("backend"), entry.get("endpoint")


def _show(value: Any) -> str:
    return "(unset)" if value is None else repr(value)
