"""The last settled requests, one record each: what Sluice charged, on what basis, for
which request (Envoy's ``x-request-id``, which the engine sees too).

It exists so that a bill can be held against what the engines did for the same
requests (the simulated engine keeps that record, ``bench/simbackend/work.py``): a test
or an operator reads ``/debug/settled?after=N`` and matches the two by request id. A
bounded ring: the newest ``limit`` records, numbered from 1 so a reader can ask for the
ones after the last it saw.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class SettleRecord:
    seq: int
    request_id: str
    tenant: str
    how: str  # how the stream ended (end_of_stream, disconnect, error, rejected)
    status: int  # the response status, 0 if none came
    basis: str  # extproc.policy.charge.Basis
    prompt: int  # prompt tokens counted
    reserved: int  # tokens pre-charged (prompt + reserved completion)
    charged: int


class SettleLog:
    def __init__(self, limit: int = LIMIT) -> None:
        self.records: deque[SettleRecord] = deque(maxlen=limit)
        self.count = 0

    def add(
        self,
        request_id: str,
        tenant: str,
        how: str,
        status: int,
        basis: str,
        prompt: int,
        reserved: int,
        charged: int,
    ) -> None:
        self.count += 1
        self.records.append(
            SettleRecord(
                self.count, request_id, tenant, how, status, basis, prompt, reserved, charged
            )
        )

    def report(self, after: int = 0) -> dict[str, Any]:
        """What GET /debug/settled returns: the records numbered above ``after`` still kept."""
        keep = max(0, min(len(self.records), self.count - after))
        recs = list(self.records)[len(self.records) - keep :] if keep else []
        return {"count": self.count, "requests": [asdict(r) for r in recs]}
