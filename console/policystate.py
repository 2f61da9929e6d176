"""The effective policy: the files' base layer, the operators' overrides, and its ETag.

The base is re-read when the files' names, sizes or mtimes change, checked at most
every ``reload_interval`` seconds and only when a request asks for the policy (no
background thread to start or stop). An invalid edit of the files keeps the last
good base and is shown on every page; a first start with broken files falls back to
the last import stored in the database.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from console import audit, basefiles, overrides, validation
from console.basefiles import Base, BaseError
from console.overrides import Conflict, Override
from console.store import Store
from extproc.policy import schema
from extproc.policyfile import fingerprint

FILES_ACTOR = "files"


@dataclass(frozen=True)
class Snapshot:
    doc: dict[str, Any]  # gateway, backends, tiers, tenants, breakers
    body: bytes  # canonical JSON, what replicas get
    etag: str
    policy: schema.Policy
    base: Base
    overrides: list[Override]  # active and applied
    conflicts: list[Conflict]
    next_expiry: float | None = None
    key: tuple[Any, ...] = field(default=(), repr=False)

    def policy_doc(self) -> dict[str, Any]:
        """What an export writes: the files' sections with overrides; the console's manual
        breakers are operational state and stay out (the files' own breakers stay in)."""
        out = {k: self.doc[k] for k in validation.POLICY_SECTIONS if k in self.doc}
        if "breakers" in self.base.doc:
            out["breakers"] = self.base.doc["breakers"]
        return out


class NoPolicy(RuntimeError):
    """Neither the files nor the database hold a valid policy."""


def etag_for(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def _check(doc: dict[str, Any]) -> list[str]:
    return [p.message for p in validation.problems(doc)]


def load_overrides(store: Store) -> list[Override]:
    rows = store.query("SELECT * FROM overrides WHERE active = 1 ORDER BY at, id")
    return [Override(id=r["id"], scope=r["scope"], target=r["target"], field=r["field"],
                     value=json.loads(r["value"]) if r["value"] is not None else None,
                     base_value=json.loads(r["base_value"]) if r["base_value"] is not None else None,
                     actor=r["actor"], at=r["at"], reason=r["reason"]) for r in rows]


class PolicyState:
    def __init__(self, store: Store, policy_dir: Path, reload_interval: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.store = store
        self.policy_dir = policy_dir
        self.reload_interval = reload_interval
        self.clock = clock
        self.base: Base | None = None
        self.base_problems: list[str] = []
        self._fingerprint: tuple[Any, ...] | None = None
        self._last_check = float("-inf")
        self._files_lock = threading.Lock()
        self._snap_lock = threading.Lock()
        self._snap: Snapshot | None = None
        # Held from "validate against the current policy" to "commit": edits are serialised.
        self.edit_lock = threading.RLock()
        row = store.one("SELECT files FROM imports ORDER BY id DESC LIMIT 1")
        if row is not None:
            self.base = basefiles.from_texts(json.loads(row["files"]))
        self.check_files(force=True)

    # -- the files -------------------------------------------------------------
    def check_files(self, force: bool = False) -> bool:
        """Re-import the files if they changed; True when the base changed."""
        mono = time.monotonic()
        if not force and mono - self._last_check < self.reload_interval:
            return False
        with self._files_lock:
            self._last_check = mono
            fp = fingerprint(self.policy_dir)
            if fp == self._fingerprint and not force:
                return False
            self._fingerprint = fp
            try:
                base = basefiles.read_dir(self.policy_dir)
                found = _check(base.doc)
            except BaseError as exc:
                found = exc.problems
            if found:
                self._import_failed(found)
                return False
            self.base_problems = []
            if self.base is not None and self.base.sha == base.sha:
                self.base = base  # same content; comments or layout may differ
                return False
            self._record_import(base)
            return True

    def _import_failed(self, found: list[str]) -> None:
        if found == self.base_problems:
            return
        self.base_problems = found
        with self.store.write() as db:
            audit.record(db, at=self.clock(), actor=FILES_ACTOR, kind="policy.import_failed",
                         target=str(self.policy_dir), summary=f"policy files rejected: {len(found)} problem(s)",
                         detail={"problems": found})

    def _record_import(self, base: Base) -> None:
        now = self.clock()
        first = self.base is None
        with self.store.write() as db:
            db.execute("INSERT INTO imports (at, sha, files, doc) VALUES (?, ?, ?, ?)",
                       [now, base.sha, json.dumps(base.files), basefiles.canonical_json(base.doc)])
            audit.record(db, at=now, actor=FILES_ACTOR, kind="policy.import", target=str(self.policy_dir),
                         summary=f"{'imported' if first else 're-imported'} {len(base.files)} policy file(s), "
                                 f"sha256 {base.sha[:12]}",
                         detail={"files": sorted(base.files)})
        self.base = base
        self.store.policy_changed()

    # -- the effective policy ----------------------------------------------------
    def snapshot(self) -> Snapshot:
        self.check_files()
        if self.base is None:
            raise NoPolicy("; ".join(self.base_problems) or "no policy imported yet")
        now = self.clock()
        with self._snap_lock:
            snap = self._snap
            key = (self.base.sha, self.store.generation)
            if snap is not None and snap.key == key and (snap.next_expiry is None or now < snap.next_expiry):
                return snap
            snap = self._compute(self.base, now, key)
            self._snap = snap
            return snap

    def _compute(self, base: Base, now: float, key: tuple[Any, ...]) -> Snapshot:
        result = overrides.apply(base.doc, load_overrides(self.store), now, _check)
        try:
            policy = validation.build(result.doc)
        except schema.PolicyError as exc:
            # Only when the base itself no longer validates (a schema change under a stored import).
            raise NoPolicy(str(exc)) from None
        body = basefiles.canonical_json(result.doc).encode()
        return Snapshot(doc=result.doc, body=body, etag=etag_for(body), policy=policy,
                        base=base, overrides=result.applied, conflicts=result.conflicts,
                        next_expiry=result.next_expiry, key=key)

    def wait_change(self, etags: set[str], timeout: float) -> Snapshot:
        """Long-poll: the first snapshot whose ETag is not in ``etags``, or the current one at timeout."""
        deadline = time.monotonic() + timeout
        # Wake up now and then even without a write: file edits and breaker expiry
        # change the policy without anyone calling policy_changed().
        tick = max(0.05, min(1.0, self.reload_interval or 0.25))
        while True:
            generation = self.store.generation
            snap = self.snapshot()
            remaining = deadline - time.monotonic()
            if snap.etag not in etags or remaining <= 0 or self.store.closing:
                return snap
            self.store.wait_for_change(generation, min(remaining, tick))
