"""The admitted requests of one backend that could give KV room back, and the revocations.

``extproc.policy.revoke`` decides (pure); this keeps what it decides on: every admitted
request of the backend with a handle to its stream (``Revocable``), and the revocations
in flight. A revoked request keeps its hold until its stream ends and settles (the
stream answers Envoy, Envoy resets the upstream request, the engine aborts): its room is
counted as *freeing* meanwhile, so the next waiter does not revoke a second request for
the same room. ``untrack`` (at release) ends that and records how long the revocation
took, from the decision to the release.

Recent revocations are kept with the request's ``x-request-id`` and the wall time of the
decision, so a benchmark can join them with the engine's abort log (``/admin/aborts`` of
the simulated engine) for the decision-to-engine-free latency.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.policy.kv_shares import KvShare
from extproc.policy.revoke import Need, Running, plan

__all__ = ["Progress", "Revocable", "Revocations", "Tracked"]

RECENT = 256


@dataclass(frozen=True, slots=True)
class Progress:
    """How far an admitted request has got, as its stream sees it."""

    answered: bool  # the client has response headers: a 503 can no longer replace the answer
    waste: (
        int  # work lost if it ends now: prompt tokens prefilled plus tokens generated (estimated)
    )
    generated: int = 0  # tokens generated so far (estimated where they are not read)


class Revocable(Protocol):
    """The stream of an admitted request, as revocation sees it."""

    request_id: str

    def progress(self, now: float) -> Progress: ...

    def revoke(self, message: str, retry_after_s: float) -> None:
        """End the request: a 503 ``revoked`` if unanswered, else an error event; it then
        settles."""
        ...


@dataclass
class Tracked:
    key: int  # the hold's grant id
    tier: str
    kv: int
    endpoint: str | None
    admitted_at: float
    handle: Revocable
    revoked_at: float | None = None  # the decision, on the runtime's clock
    revoked_wall: float | None = None


@dataclass
class Revocations:
    running: dict[int, Tracked] = field(default_factory=dict)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tier, kind) -> revocations
    wasted: Counter[str] = field(default_factory=Counter)  # tier -> work thrown away, in tokens
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT))
    to_release_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    # Not yet exported as metrics (``drain``): the monitor turns them into counter increments.
    _new_counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _new_wasted: Counter[str] = field(default_factory=Counter)

    def track(
        self,
        key: int,
        tier: str,
        kv: int,
        endpoint: str | None,
        admitted_at: float,
        handle: Revocable,
    ) -> None:
        self.running[key] = Tracked(key, tier, kv, endpoint, admitted_at, handle)

    def untrack(self, key: int, wall: float) -> None:
        """The request's hold is released (``wall``: time.time(), as the decision's)."""
        t = self.running.pop(key, None)
        if t is not None and t.revoked_wall is not None:
            self.to_release_s.append(wall - t.revoked_wall)

    def freeing(self, endpoint: str | None = None) -> int:
        """KV of revoked requests not yet released (on ``endpoint``, or anywhere)."""
        return sum(
            t.kv
            for t in self.running.values()
            if t.revoked_at is not None and (endpoint is None or t.endpoint == endpoint)
        )

    def candidates(self, now: float) -> list[Running]:
        out = []
        for t in self.running.values():
            if t.revoked_at is not None:
                continue
            p = t.handle.progress(now)
            out.append(Running(t.key, t.tier, t.kv, p.answered, p.waste, t.admitted_at, t.endpoint))
        return out

    def reclaim(
        self,
        need: Need,
        now: float,
        wall: float,
        priorities: Mapping[str, int],
        revocable: Mapping[str, bool],
        shares: Mapping[str, KvShare],
        held: Mapping[str, int],
        active: Mapping[str, bool],
        budget: float,
        retry_after_s: Callable[[str], float],
    ) -> int:
        """Revoke what ``need`` calls for (less what is already freeing); returns the KV freeing."""
        need = Need(need.tier, need.kv - self.freeing(need.endpoint), need.endpoint)
        if need.kv <= 0:
            return 0
        victims = plan(
            self.candidates(now), need, priorities, revocable, shares, held, active, budget
        )
        for v in victims:
            t = self.running[v.id]
            kind = "streaming" if v.producing else "unanswered"
            t.revoked_at, t.revoked_wall = now, wall
            self.counts[(t.tier, kind)] += 1
            self.wasted[t.tier] += v.waste
            self._new_counts[(t.tier, kind)] += 1
            self._new_wasted[t.tier] += v.waste
            self.recent.append(
                {
                    "request_id": t.handle.request_id,
                    "tier": t.tier,
                    "kind": kind,
                    "kv": t.kv,
                    "for_tier": need.tier,
                    "waste": v.waste,
                    "at": wall,
                }
            )
            t.handle.revoke(
                f"Revoked to make room for a request of a higher tier; retry in "
                f"{retry_after_s(t.tier):.0f} s.",
                retry_after_s(t.tier),
            )
        return sum(v.kv for v in victims)

    def drain(self) -> tuple[Counter[tuple[str, str]], Counter[str]]:
        """The revocations and the work thrown away since the last call."""
        out = self._new_counts, self._new_wasted
        self._new_counts, self._new_wasted = Counter(), Counter()
        return out

    def status(self) -> dict[str, Any]:
        lat = sorted(self.to_release_s)
        return {
            "tracked": len(self.running),
            "freeing_tokens": self.freeing(),
            "revoked": {f"{tier}/{kind}": n for (tier, kind), n in sorted(self.counts.items())},
            "wasted_tokens": dict(self.wasted),
            "decision_to_release_ms": None
            if not lat
            else {
                "p50": round(lat[len(lat) // 2] * 1000, 2),
                "max": round(lat[-1] * 1000, 2),
                "n": len(lat),
            },
            "recent": list(self.recent),
        }
