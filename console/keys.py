"""Tenants and API keys from the console: create a tenant, issue, revoke and rotate keys.

A key is generated here, shown to the operator once and stored only as its sha256
(``sha256:<hex>``, the form ``policies/tenants.yaml`` uses). Each change is an override
("tenant_new", or "key" with the hash as its field: a value adds the hash, null removes
one the files hold), validated with the policy schema on the would-be effective policy
under the edit lock, audited in the same transaction, and exported to YAML like every
other override. Replicas get it through the policy API within about a second.
"""

from __future__ import annotations

import copy
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from console import audit, overrides, validation
from console.edits import _deactivate, _insert
from console.policystate import PolicyState
from console.validation import PathProblem
from extproc.policy.schema import hash_key

KEY_PREFIX = "sk-sluice-"
HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hint(key: str) -> str:
    """Enough of a key to tell it apart in a list, far too little to use it."""
    return key[: len(KEY_PREFIX) + 4] + "…"


@dataclass
class KeyResult:
    ok: bool
    problems: list[PathProblem] = field(default_factory=list)
    key: str | None = None  # the new key, in clear: shown once, never stored
    key_hash: str | None = None


def _fail(path: tuple[str | int, ...], message: str) -> KeyResult:
    return KeyResult(False, [PathProblem(path, message)])


def _tenant_index(doc: dict[str, Any], name: str) -> int:
    names = [t.get("name") if isinstance(t, dict) else None for t in doc.get("tenants") or []]
    return names.index(name) if name in names else -1


def _relative(found: list[PathProblem], index: int) -> list[PathProblem]:
    """Problems of the edited tenant with paths relative to it (``("tier",)``)."""
    prefix = ("tenants", index)
    return [PathProblem(p.path[2:] if p.path[:2] == prefix else (), p.message) for p in found]


def _issue_value(actor: str, now: float, key: str) -> dict[str, Any]:
    return {"by": actor, "at": now, "hint": hint(key)}


def create_tenant(state: PolicyState, *, actor: str, name: str, tier: str, reason: str) -> KeyResult:
    """A new tenant on ``tier`` with a first key (a tenant without keys is not valid)."""
    with state.edit_lock:
        snap = state.snapshot()
        if overrides.entity(snap.doc, "tenant", name) is not None:
            return _fail(("name",), f"tenant {name!r} already exists")
        key = new_key()
        digest = hash_key(key)
        candidate = copy.deepcopy(snap.doc)
        if not isinstance(candidate.get("tenants"), list):
            candidate["tenants"] = []
        candidate["tenants"].append({"name": name, "tier": tier, "keys": [digest]})
        found = validation.problems(candidate)
        if found:
            return KeyResult(False, _relative(found, len(candidate["tenants"]) - 1))
        now = state.clock()
        with state.store.write() as db:
            _insert(db, "tenant_new", name, "", {"name": name, "tier": tier}, None, actor, now, reason)
            _insert(db, "key", name, digest, _issue_value(actor, now, key), None, actor, now, reason)
            audit.record(db, at=now, actor=actor, kind="tenant.create", target=name,
                         summary=f"tenant created on tier {tier} with key {hint(key)}", reason=reason,
                         detail={"tier": tier, "key_hash": digest})
        state.store.policy_changed()
        return KeyResult(True, key=key, key_hash=digest)


def issue_key(state: PolicyState, *, actor: str, tenant: str, reason: str) -> KeyResult:
    with state.edit_lock:
        snap = state.snapshot()
        if overrides.entity(snap.doc, "tenant", tenant) is None:
            return _fail((), f"no tenant {tenant!r}")
        key = new_key()
        digest = hash_key(key)
        now = state.clock()
        with state.store.write() as db:
            _insert(db, "key", tenant, digest, _issue_value(actor, now, key), None, actor, now, reason)
            audit.record(db, at=now, actor=actor, kind="key.issue", target=tenant,
                         summary=f"key {hint(key)} issued", reason=reason, detail={"key_hash": digest})
        state.store.policy_changed()
        return KeyResult(True, key=key, key_hash=digest)


def _without(doc: dict[str, Any], tenant: str, digest: str) -> tuple[dict[str, Any], list[PathProblem]]:
    candidate = copy.deepcopy(doc)
    item = overrides.entity(candidate, "tenant", tenant)
    assert item is not None
    keys = item.get("keys") if isinstance(item.get("keys"), list) else []
    item["keys"] = [k for k in keys if k != digest]
    if not item["keys"]:
        return candidate, [PathProblem(("keys",), "a tenant needs at least one key: rotate this one, or issue "
                                                  "another first")]
    return candidate, _relative(validation.problems(candidate), _tenant_index(candidate, tenant))


def _remove(db: Any, snap_base: dict[str, Any], tenant: str, digest: str, actor: str, now: float,
            reason: str) -> None:
    """Revoke ``digest``: drop the console's own issue, and mask the files' copy if they hold it."""
    _deactivate(db, "key", tenant, digest)
    in_files = overrides.entity(snap_base, "tenant", tenant)
    if in_files is not None and digest in (in_files.get("keys") or []):
        _insert(db, "key", tenant, digest, None, digest, actor, now, reason)


def revoke_key(state: PolicyState, *, actor: str, tenant: str, key_hash: str, reason: str) -> KeyResult:
    with state.edit_lock:
        snap = state.snapshot()
        item = overrides.entity(snap.doc, "tenant", tenant)
        if item is None or key_hash not in (item.get("keys") or []):
            return _fail((), f"tenant {tenant!r} has no key {key_hash[:19]}…")
        _, found = _without(snap.doc, tenant, key_hash)
        if found:
            return KeyResult(False, found)
        now = state.clock()
        with state.store.write() as db:
            _remove(db, snap.base.doc, tenant, key_hash, actor, now, reason)
            audit.record(db, at=now, actor=actor, kind="key.revoke", target=tenant,
                         summary=f"key {key_hash[:19]}… revoked", reason=reason, detail={"key_hash": key_hash})
        state.store.policy_changed()
        return KeyResult(True, key_hash=key_hash)


def rotate_key(state: PolicyState, *, actor: str, tenant: str, key_hash: str, reason: str) -> KeyResult:
    """A new key replaces ``key_hash`` in one step: the old one stops working when the
    replicas take the new policy (about a second), the new one starts at the same time."""
    with state.edit_lock:
        snap = state.snapshot()
        item = overrides.entity(snap.doc, "tenant", tenant)
        if item is None or key_hash not in (item.get("keys") or []):
            return _fail((), f"tenant {tenant!r} has no key {key_hash[:19]}…")
        key = new_key()
        digest = hash_key(key)
        now = state.clock()
        with state.store.write() as db:
            _remove(db, snap.base.doc, tenant, key_hash, actor, now, reason)
            _insert(db, "key", tenant, digest, _issue_value(actor, now, key), None, actor, now, reason)
            audit.record(db, at=now, actor=actor, kind="key.rotate", target=tenant,
                         summary=f"key {key_hash[:19]}… replaced by {hint(key)}", reason=reason,
                         detail={"from": key_hash, "to": digest})
        state.store.policy_changed()
        return KeyResult(True, key=key, key_hash=digest)


@dataclass(frozen=True)
class KeyView:
    hash: str
    source: str  # "files" or "console"
    by: str | None = None
    at: float | None = None
    hint: str | None = None


def key_views(snap: Any, tenant: str) -> list[KeyView]:
    """The tenant's effective keys: where each comes from, who issued it."""
    item = overrides.entity(snap.doc, "tenant", tenant)
    if item is None:
        return []
    issued = {o.field: o for o in snap.overrides if o.scope == "key" and o.target == tenant and o.value}
    out = []
    for k in item.get("keys") or []:
        ov = issued.get(k)
        if ov is not None:
            out.append(KeyView(k, "console", ov.value.get("by"), ov.value.get("at"), ov.value.get("hint")))
        else:
            out.append(KeyView(k, "files"))
    return out
