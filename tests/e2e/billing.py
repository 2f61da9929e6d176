"""The invariant every end-to-end test can hold Sluice to: what it charged each request
equals what the engine processed for it, within the bound of what the charge rests on.

Both sides keep a record per request under Envoy's ``x-request-id``: Sluice at
``/debug/settled`` (extproc/runtime/settle_log.py: tenant, basis, prompt, reserved,
charged) and the simulated engine at ``/admin/work`` (bench/simbackend/work.py: prompt
tokens prefilled, tokens generated, finished_reason). ``Billing`` reads both from a mark
and pairs them. The bound of each basis (extproc/policy/charge.py says why):

- ``reported``: charged == processed, exactly.
- ``counted``: charged <= processed <= charged + ``counted_slack`` (tokens the engine
  produced after the last chunk Sluice saw, in flight when the stream was cut).
- ``estimated``: prompt <= charged <= reserved, and processed <= charged + ``estimate_slack``
  (an estimate covers the engine's work when the learned rate is not below the engine's;
  the slack is the test's allowance for the rate's error). ``estimate_over`` (if set)
  bounds charged - processed too.
- ``failed``: charged 0; the engine did nothing, unless ``failed_work`` allows it (a
  failure after generating is not billed: the operator's loss).
- ``not_sent``: charged 0 and no engine record. ``refused_counted``: charged the counted
  prompt, no engine record.

And the other way round: every engine record that names a tenant (a request Sluice
forwarded) has a settle record, so nothing the engine did goes unsettled. Engine records
without a tenant (Sluice's own probes, pass-through paths) are not billable and ignored.

    billing = Billing.of(stack)        # marks now
    ... requests ...
    billing.check()                    # waits for both sides, then asserts every bound
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.procs import get_json

BASES = ("reported", "counted", "estimated", "failed", "not_sent", "refused_counted")


@dataclass(frozen=True)
class Pair:
    request_id: str
    settled: dict[str, Any] | None
    work: dict[str, Any] | None

    @property
    def processed(self) -> int:
        return 0 if self.work is None else self.work["prompt_tokens"] + self.work["generation_tokens"]

    @property
    def charged(self) -> int:
        return 0 if self.settled is None else self.settled["charged"]

    @property
    def basis(self) -> str | None:
        return None if self.settled is None else self.settled["basis"]

    def __str__(self) -> str:
        return f"{self.request_id}: settled {self.settled} / engine {self.work}"


@dataclass
class Billing:
    admin_urls: Sequence[str]  # each extproc replica's admin port
    sim_urls: Sequence[str]  # each engine
    counted_slack: int = 32
    estimate_slack: int = 32
    estimate_over: int | None = None
    failed_work: bool = False
    _settle_marks: dict[str, int] = field(default_factory=dict)
    _work_marks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, stack: Any, **bounds: Any) -> Billing:
        """For the harness's one-engine Stack (or anything with ``admin_url`` and ``sim_url``)."""
        return cls([stack.admin_url], [stack.sim_url], **bounds).mark()

    def mark(self) -> Billing:
        """Only requests settled and processed after this count."""
        self._settle_marks = {u: get_json(f"{u}/debug/settled?after=999999999")["count"] for u in self.admin_urls}
        self._work_marks = {u: get_json(f"{u}/admin/work?after=999999999")["count"] for u in self.sim_urls}
        return self

    # -- reading both sides ----------------------------------------------------------
    def _settled(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for u in self.admin_urls:
            rep = get_json(f"{u}/debug/settled?after={self._settle_marks.get(u, 0)}")
            out.update({r["request_id"]: r for r in rep["requests"] if r["request_id"]})
        return out

    def _work(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for u in self.sim_urls:
            rep = get_json(f"{u}/admin/work?after={self._work_marks.get(u, 0)}")
            out.update({w["request_id"]: w for w in rep["requests"] if w["request_id"]})
        return out

    def pairs(self, timeout: float = 5.0) -> list[Pair]:
        """Every request either side recorded since the mark, once both sides agree it ended:
        a forwarded request's engine record and every billable engine record's settle record."""
        deadline = time.monotonic() + timeout
        while True:
            settled, work = self._settled(), self._work()
            waiting = [rid for rid, s in settled.items()
                       if s["basis"] in ("reported", "counted", "estimated") and rid not in work]
            waiting += [rid for rid, w in work.items() if w["tenant"] and rid not in settled]
            if not waiting or time.monotonic() > deadline:
                ids = sorted(set(settled) | {rid for rid, w in work.items() if w["tenant"]})
                return [Pair(rid, settled.get(rid), work.get(rid)) for rid in ids]
            time.sleep(0.05)

    # -- the invariant ------------------------------------------------------------------
    def problems(self, pairs: Sequence[Pair]) -> list[str]:
        """Every pair outside its basis' bound, said in a sentence each."""
        out = []
        for p in pairs:
            s, w = p.settled, p.work
            if s is None:
                out.append(f"processed but never settled: {p}")
                continue
            basis, charged, done = s["basis"], p.charged, p.processed
            if basis == "reported" and charged != done:
                out.append(f"reported usage {charged} != engine {done}: {p}")
            elif basis == "counted" and not charged <= done <= charged + self.counted_slack:
                out.append(f"counted {charged}, engine {done} (slack {self.counted_slack}): {p}")
            elif basis == "estimated":
                if not s["prompt"] <= charged <= s["reserved"]:
                    out.append(f"estimate {charged} outside [prompt, reserved]: {p}")
                if done > charged + self.estimate_slack:
                    out.append(f"undercharged: estimate {charged}, engine {done} (slack {self.estimate_slack}): {p}")
                if self.estimate_over is not None and charged - done > self.estimate_over:
                    out.append(f"overcharged: estimate {charged}, engine {done} (over {self.estimate_over}): {p}")
            elif basis == "failed" and (charged != 0 or (done and not self.failed_work)):
                out.append(f"a failed request charged {charged}, engine {done}: {p}")
            elif basis in ("not_sent", "refused_counted"):
                want = 0 if basis == "not_sent" else s["prompt"]
                if charged != want or w is not None:
                    out.append(f"{basis}: charged {charged} (want {want}), engine record {w}: {p}")
            elif basis not in BASES:
                out.append(f"unknown basis {basis!r}: {p}")
        return out

    def check(self, timeout: float = 5.0, expect: dict[str, int] | None = None) -> list[Pair]:
        """Assert the invariant for everything since the mark; ``expect``: how many pairs of each
        basis the test made (so a test cannot pass by making none). Returns the pairs."""
        pairs = self.pairs(timeout)
        bad = self.problems(pairs)
        assert not bad, "charged != processed:\n" + "\n".join(bad)
        if expect is not None:
            got = {b: sum(1 for p in pairs if p.basis == b) for b in expect}
            assert got == expect, f"bases {got}, expected {expect}: " + "\n".join(map(str, pairs))
        return pairs

    def totals(self, pairs: Sequence[Pair]) -> tuple[int, int]:
        """(charged, processed) over ``pairs``."""
        return sum(p.charged for p in pairs), sum(p.processed for p in pairs)
