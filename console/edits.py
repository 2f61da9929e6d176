"""Operator changes: validate against the current effective policy, then store and audit.

Validation and the write happen under one lock, so two operators editing at once
cannot each pass validation and together break the policy.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from console import audit, overrides, validation
from console.policystate import PolicyState
from console.validation import PathProblem


@dataclass
class EditResult:
    ok: bool
    problems: list[PathProblem] = field(default_factory=list)
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # field -> (before, after)


def _fmt(value: Any) -> str:
    return "—" if value is None else str(value)


def set_fields(state: PolicyState, *, actor: str, scope: str, target: str, values: dict[str, Any],
               reason: str) -> EditResult:
    """Set fields of one tenant or tier; ``None`` unsets (back to the tier's or schema's default)."""
    with state.edit_lock:
        snap = state.snapshot()
        candidate = copy.deepcopy(snap.doc)
        item = overrides.entity(candidate, scope, target)
        if item is None:
            return EditResult(False, [PathProblem((), f"{scope} {target!r} does not exist")])
        changed = {k: (overrides.get_field(item, k), v) for k, v in values.items()
                   if overrides.get_field(item, k) != v}
        if not changed:
            return EditResult(True)
        for k, v in values.items():
            overrides.set_field(item, k, v)
        found = validation.problems(candidate)
        if found:
            return EditResult(False, found)
        now = state.clock()
        with state.store.write() as db:
            for name, (_, after) in changed.items():
                base = overrides.base_value(snap.base.doc, scope, target, name)
                _deactivate(db, scope, target, name)
                if after != base:  # setting the files' value back is a revert, not an override
                    _insert(db, scope, target, name, after, base, actor, now, reason)
            summary = "; ".join(f"{k}: {_fmt(a)} → {_fmt(b)}" for k, (a, b) in changed.items())
            audit.record(db, at=now, actor=actor, kind=f"{scope}.update", target=target, summary=summary,
                         reason=reason, detail={k: {"from": a, "to": b} for k, (a, b) in changed.items()})
        state.store.policy_changed()
        return EditResult(True, changed=changed)


BREAKER_ACTIONS = {"trip": "open", "reset": "closed", "clear": None}


def set_breaker(state: PolicyState, *, actor: str, backend: str, action: str, reason: str,
                minutes: float | None, endpoint: str | None = None) -> EditResult:
    """Trip (force open), reset (force closed) or clear (back to automatic) a backend's breaker,
    or with ``endpoint`` (``host:port``) that one endpoint's of a pool.

    A forced state holds until ``minutes`` pass or it is cleared; the data plane's
    automatic breaker is suspended meanwhile and resumes when the entry goes away.
    """
    with state.edit_lock:
        snap = state.snapshot()
        item = overrides.entity(snap.doc, "breaker", backend)
        if item is None:
            return EditResult(False, [PathProblem(("backend",), f"unknown backend {backend!r}")])
        if endpoint is not None and endpoint not in overrides.endpoint_addresses(item):
            known = ", ".join(overrides.endpoint_addresses(item)) or "none: it is not a pool"
            return EditResult(False, [PathProblem(("endpoint",), f"backend {backend!r} has no endpoint "
                                                                 f"{endpoint!r} (its endpoints: {known})")])
        now = state.clock()
        name = overrides.breaker_field(endpoint)
        if action == "clear":
            return _clear_breaker(state, actor=actor, backend=backend, reason=reason, now=now, endpoint=endpoint)
        until = now + minutes * 60 if minutes else None
        entry = {"backend": backend, "state": BREAKER_ACTIONS[action], "reason": reason,
                 "until": until, "by": actor, "at": now}
        if endpoint is not None:
            entry["endpoint"] = endpoint
        whose = f"endpoint {endpoint}: " if endpoint is not None else ""
        with state.store.write() as db:
            _deactivate(db, "breaker", backend, name)
            _insert(db, "breaker", backend, name, entry, None, actor, now, reason)
            held = f" for {minutes:g} min" if minutes else ""
            audit.record(
                db,
                at=now,
                actor=actor,
                kind=f"breaker.{action}",
                target=backend,
                summary=f"{whose}breaker {'tripped (forced open)' if action == 'trip' else 'reset (forced closed)'}"
                f"{held or ' until cleared'}",
                reason=reason,
                detail=entry,
            )
        state.store.policy_changed()
        return EditResult(True)


def _clear_breaker(state: PolicyState, *, actor: str, backend: str, reason: str, now: float,
                   endpoint: str | None = None) -> EditResult:
    name = overrides.breaker_field(endpoint)
    rows = state.store.query("SELECT id FROM overrides WHERE active = 1 AND scope = 'breaker' AND target = ? "
                             "AND field = ?", [backend, name])
    if not rows:
        return EditResult(False, [PathProblem(("action",), "no manual override to clear: the breaker is automatic")])
    whose = f"endpoint {endpoint}: " if endpoint is not None else ""
    with state.store.write() as db:
        _deactivate(db, "breaker", backend, name)
        audit.record(db, at=now, actor=actor, kind="breaker.clear", target=backend,
                     summary=f"{whose}manual override cleared: the automatic breaker decides again", reason=reason,
                     detail={"endpoint": endpoint} if endpoint is not None else None)
    state.store.policy_changed()
    return EditResult(True)


def revert(state: PolicyState, *, actor: str, override_id: int, reason: str) -> bool:
    with state.edit_lock:
        row = state.store.one("SELECT * FROM overrides WHERE id = ? AND active = 1", [override_id])
        if row is None:
            return False
        now = state.clock()
        orphans = row["scope"] == "tenant_new" and overrides.entity(state.snapshot().base.doc, "tenant",
                                                                    row["target"]) is None
        with state.store.write() as db:
            db.execute("UPDATE overrides SET active = 0 WHERE id = ?", [override_id])
            if orphans:  # a created tenant taken back takes the keys issued to it along
                _deactivate_all(db, "key", row["target"])
            audit.record(db, at=now, actor=actor, kind="override.revert", target=row["target"],
                         summary=f"reverted {row['scope']} {row['target']}.{row['field']} to the files' value",
                         reason=reason, detail={"override": override_id, "value": json.loads(row["value"] or "null")})
        state.store.policy_changed()
        return True


def keep(state: PolicyState, *, actor: str, override_id: int, reason: str) -> bool:
    """Resolve a "changed" conflict in favour of the override: it now sits on the new base value."""
    with state.edit_lock:
        row = state.store.one("SELECT * FROM overrides WHERE id = ? AND active = 1", [override_id])
        snap = state.snapshot()
        if row is None:
            return False
        base = overrides.base_value(snap.base.doc, row["scope"], row["target"], row["field"])
        now = state.clock()
        with state.store.write() as db:
            db.execute("UPDATE overrides SET base_value = ? WHERE id = ?", [json.dumps(base), override_id])
            audit.record(db, at=now, actor=actor, kind="override.keep", target=row["target"],
                         summary=f"kept override of {row['scope']} {row['target']}.{row['field']} "
                                 f"over the files' new value {_fmt(base)}",
                         reason=reason, detail={"override": override_id, "base_value": base})
        state.store.policy_changed()
        return True


def _deactivate(db: Any, scope: str, target: str, name: str) -> None:
    db.execute("UPDATE overrides SET active = 0 WHERE active = 1 AND scope = ? AND target = ? AND field = ?",
               [scope, target, name])


def _deactivate_all(db: Any, scope: str, target: str) -> None:
    db.execute("UPDATE overrides SET active = 0 WHERE active = 1 AND scope = ? AND target = ?", [scope, target])


def _insert(db: Any, scope: str, target: str, name: str, value: Any, base: Any, actor: str, at: float,
            reason: str) -> None:
    db.execute("INSERT INTO overrides (scope, target, field, value, base_value, actor, at, reason) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               [scope, target, name, json.dumps(value), json.dumps(base) if base is not None else None,
                actor, at, reason])
