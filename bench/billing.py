"""Charged against processed: Sluice's settle records held against the engine's own work
records, request by request, within the bound of the basis each charge rests on.

Both sides key a record by Envoy's ``x-request-id``: Sluice at ``/debug/settled``
(extproc/runtime/settle_log.py: tenant, basis, prompt, reserved, charged), the simulated
engine at ``/admin/work`` (bench/simbackend/work.py: prompt tokens prefilled, tokens
generated, finished_reason). The bound of each basis (extproc/policy/charge.py says why):

- ``reported``: charged == processed, exactly.
- ``counted``: charged <= processed <= charged + ``counted_slack`` (tokens the engine
  produced after the last chunk Sluice saw: in flight when the stream was cut).
- ``estimated``: prompt <= charged <= reserved, and processed <= charged +
  ``estimate_slack`` (an estimate covers the engine's work when the learned decode rate
  is not below the engine's; the slack is the allowance for the rate's error).
  ``estimate_over``, if set, bounds charged - processed as well.
- ``failed``: charged 0; the engine did nothing, unless ``failed_work`` (a failure
  after generating is not billed: the operator's loss).
- ``revoked``: charged 0 (Sluice ended it before any answer, for a higher tier); the
  engine either never saw it or aborted it (finished_reason ``abort``).
- ``not_sent``: charged 0 and no engine record; ``refused_counted``: charged the counted
  prompt and no engine record.

Used by the end-to-end tests (tests/e2e/billing.py) and the soak (bench/soak.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.procs import get_json

BASES = ("reported", "counted", "estimated", "failed", "revoked", "not_sent", "refused_counted")
SENT = frozenset({"reported", "counted", "estimated"})  # the engine must have a record of these


@dataclass(frozen=True)
class Bounds:
    counted_slack: int = 32
    estimate_slack: int = 32
    estimate_over: int | None = None
    failed_work: bool = False


@dataclass(frozen=True)
class Pair:
    request_id: str
    settled: Mapping[str, Any] | None
    work: Mapping[str, Any] | None

    @property
    def processed(self) -> int:
        return (
            0 if self.work is None else self.work["prompt_tokens"] + self.work["generation_tokens"]
        )

    @property
    def charged(self) -> int:
        return 0 if self.settled is None else self.settled["charged"]

    @property
    def basis(self) -> str | None:
        return None if self.settled is None else self.settled["basis"]

    def __str__(self) -> str:
        settled, work = dict(self.settled or {}), dict(self.work or {})
        return f"{self.request_id}: settled {settled} / engine {work}"


def settled_since(admin_url: str, after: int = 0) -> tuple[int, list[dict[str, Any]]]:
    """(the count so far, the records after ``after``) from one extproc's /debug/settled."""
    rep = get_json(f"{admin_url}/debug/settled?after={after}")
    return rep["count"], rep["requests"]


def work_since(sim_url: str, after: int = 0) -> tuple[int, list[dict[str, Any]]]:
    """(the count so far, the records after ``after``) from one engine's /admin/work."""
    rep = get_json(f"{sim_url}/admin/work?after={after}")
    return rep["count"], rep["requests"]


def pair(
    settled: Iterable[Mapping[str, Any]],
    work: Iterable[Mapping[str, Any]],
    billable_work: bool = True,
) -> list[Pair]:
    """Match by request id; with ``billable_work`` an engine record naming a tenant (a request
    Sluice forwarded) pairs even without a settle record, as "processed, never settled"."""
    s = {r["request_id"]: r for r in settled if r["request_id"]}
    w = {r["request_id"]: r for r in work if r["request_id"]}
    ids = set(s) | ({rid for rid, r in w.items() if r["tenant"]} if billable_work else set())
    return [Pair(rid, s.get(rid), w.get(rid)) for rid in sorted(ids)]


def problem(p: Pair, b: Bounds) -> str | None:
    """Why ``p`` is outside its basis' bound, or None."""
    s, w = p.settled, p.work
    if s is None:
        return f"processed but never settled: {p}"
    basis, charged, done = s["basis"], p.charged, p.processed
    if basis == "reported":
        return None if charged == done else f"reported usage {charged} != engine {done}: {p}"
    if basis == "counted":
        ok = charged <= done <= charged + b.counted_slack
        return None if ok else f"counted {charged}, engine {done} (slack {b.counted_slack}): {p}"
    if basis == "estimated":
        if not s["prompt"] <= charged <= s["reserved"]:
            return f"estimate {charged} outside [prompt, reserved]: {p}"
        if done > charged + b.estimate_slack:
            return (
                f"undercharged: estimate {charged}, engine {done} (slack {b.estimate_slack}): {p}"
            )
        if b.estimate_over is not None and charged - done > b.estimate_over:
            return f"overcharged: estimate {charged}, engine {done} (over {b.estimate_over}): {p}"
        return None
    if basis == "failed":
        ok = charged == 0 and (done == 0 or b.failed_work)
        return None if ok else f"a failed request charged {charged}, engine {done}: {p}"
    if basis == "revoked":
        ok = charged == 0 and (w is None or w["finished_reason"] == "abort")
        return None if ok else f"a revoked request charged {charged}, engine record {w}: {p}"
    if basis in ("not_sent", "refused_counted"):
        want = 0 if basis == "not_sent" else s["prompt"]
        return (
            None
            if charged == want and w is None
            else f"{basis}: charged {charged} (want {want}), engine record {w}: {p}"
        )
    return f"unknown basis {basis!r}: {p}"


def problems(pairs: Sequence[Pair], b: Bounds) -> list[str]:
    return [m for p in pairs if (m := problem(p, b)) is not None]


def by_basis(pairs: Sequence[Pair]) -> dict[str, tuple[int, int, int]]:
    """basis -> (requests, charged, processed)."""
    out: dict[str, tuple[int, int, int]] = {}
    for p in pairs:
        key = p.basis or "never settled"
        n, c, d = out.get(key, (0, 0, 0))
        out[key] = (n + 1, c + p.charged, d + p.processed)
    return out
