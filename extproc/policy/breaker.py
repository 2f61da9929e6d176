"""Circuit breaker for one backend (or model route): trip, cool down, probe, ramp up.

CLOSED: outcomes fill a sliding window (``window_s`` in ``window_buckets`` fixed
buckets: constant memory at any rate). It trips on ``consecutive_failures`` in a row;
on an error share >= ``error_ratio`` or a share slower than ``latency_slo_s`` >=
``latency_breach_ratio``, both once the window holds ``min_requests``; on backend
preemptions (``observe_preemptions``); or on ``trip()`` (e.g. an OOM).

OPEN denies all for ``cooldown_s * cooldown_multiplier**level`` (capped at
``max_cooldown_s``); ``level`` grows per trip and returns to 0 after
``cooldown_reset_s`` of uninterrupted CLOSED.

HALF_OPEN probes first: one request at a time until ``probe_successes`` succeed (a
probe that never reports frees its place after ``probe_timeout_s``). When no request has
come to probe for ``own_probe_after_s`` (``probe_due``), Sluice sends a probe of its own
and records it like any other: under light traffic a half-open breaker still reaches a
verdict, within the cooldown + ``own_probe_after_s`` + the ramp. Then it ramps:
step ``i`` admits ``ramp_steps[i]`` of the calls via a credit accumulator (each call
adds the fraction, a call passes when the credit reaches 1: deterministic, exact over
any run), each step lasting ``ramp_step_s``; after the last, CLOSED. Any failure in
HALF_OPEN re-opens with the next, longer cooldown; with an SLO set, so does a slow
probe, and a step whose slow share reaches ``latency_breach_ratio``.

What counts as a failure, and what is ignored: ``breaker_outcome``.
Outcomes arriving while OPEN come from requests admitted before the trip: ignored. In
HALF_OPEN every outcome, a straggler's too, is fresh evidence and counts.

Manual override (``set_manual``) decides the verdict until it expires or is cleared;
the automatic machine is suspended meanwhile (outcomes still fill the window, nothing
trips). After a manual *open* it resumes in HALF_OPEN (probe, then ramp): nobody has
seen the backend healthy since. After a manual *closed* it resumes in CLOSED with the
window gathered during the override, so a backend that kept failing trips at once.

Watching (``on_change``, ``next_change``): whoever caches what ``state`` says (a pool's
placement index, ``extproc.backends.endpoints``) is called on every transition and
whenever a ramp step starts, and asks when time alone could next change the state.

Pure: no I/O, no clock (``now`` is monotonic seconds, passed in), no threads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from extproc.policy.breaker_config import BreakerConfig
from extproc.policy.breaker_outcome import Outcome
from extproc.policy.breaker_types import (
    REASON_HALF_OPEN_THROTTLE,
    REASON_MANUAL_OPEN,
    REASON_OPEN,
    BreakerEvent,
    BreakerState,
    BreakerVerdict,
)
from extproc.policy.window import Window as _Window

__all__ = [
    "REASON_HALF_OPEN_THROTTLE",
    "REASON_MANUAL_OPEN",
    "REASON_OPEN",
    "Breaker",
    "BreakerConfig",
    "BreakerEvent",
    "BreakerState",
    "BreakerVerdict",
]

_EPS = 1e-9


@dataclass(frozen=True)
class _Manual:
    state: BreakerState
    reason: str
    until: float | None
    since: float


class Breaker:
    """One breaker. Callers serialise access (one event loop, or a lock)."""

    def __init__(self, config: BreakerConfig | None = None, now: float = 0.0) -> None:
        self.config = cfg = config or BreakerConfig()
        self._now = now
        self._state = BreakerState.CLOSED
        self._since = now
        self._open_until = now
        self._level = 0
        self._trips = 0
        self._last_cause: str | None = None
        self._window = _Window(cfg.window_s, cfg.window_buckets, 3)  # total, failed, slow
        self._preempt = _Window(cfg.window_s, cfg.window_buckets, 1)
        self._last_preempt_total: float | None = None
        self._consecutive = 0
        self._probe_since: float | None = None  # a probe is in flight since then
        self._probe_last = now  # the last time a probe place was taken or given back
        self._probe_ok = 0
        self._step = -1  # -1: probe phase; else index into ramp_steps
        self._step_start = now
        self._step_seen = [0, 0]  # outcomes, slow outcomes in the current step
        self._credit = 0.0
        self._manual: _Manual | None = None
        self._events: deque[BreakerEvent] = deque(maxlen=1000)
        self.on_change: Callable[[], None] | None = None  # called at every transition and ramp step

    def state(self, now: float) -> BreakerState:
        self._advance(now)
        return self._effective()

    def next_change(self, now: float) -> float:
        """The earliest time at which ``state`` may change with nothing recorded, tripped or
        overridden meanwhile: when the cooldown, the manual override or the ramp step ends
        (inf while none runs)."""
        now = self._advance(now)
        if (m := self._manual) is not None:
            return float("inf") if m.until is None else m.until
        if self._state is BreakerState.OPEN:
            return self._open_until
        if self._state is BreakerState.HALF_OPEN and self._step >= 0:
            return self._step_start + self.config.ramp_step_s
        return float("inf")

    def drain_events(self) -> list[BreakerEvent]:
        """Transitions since the last call, oldest first (the newest 1000 are kept)."""
        out = list(self._events)
        self._events.clear()
        return out

    def snapshot(self, now: float) -> dict[str, Any]:
        now = self._advance(now)
        total, failed, slow = self._window.prune(now)
        is_open = self._manual is None and self._state is BreakerState.OPEN
        return {
            "state": str(self._effective()),
            "automatic_state": str(self._state),
            "since": self._since,
            "cooldown_left_s": self._open_until - now if is_open else 0.0,
            "next_cooldown_s": self._cooldown(),
            "trips": self._trips,
            "trip_level": self._level,
            "last_cause": self._last_cause,
            "phase": self._phase(),
            "ramp_fraction": self._fraction(),
            "window": {"requests": int(total), "failures": int(failed), "slow": int(slow)},
            "consecutive_failures": self._consecutive,
            "preemptions_in_window": self._preempt.prune(now)[0],
            "manual": None if self._manual is None else asdict(self._manual),
        }

    def allow(self, now: float) -> BreakerVerdict:
        now = self._advance(now)
        cfg = self.config
        if (m := self._manual) is not None:
            if m.state is BreakerState.CLOSED:
                return BreakerVerdict(True, BreakerState.CLOSED)
            left = cfg.cooldown_s if m.until is None else m.until - now
            return BreakerVerdict(False, BreakerState.OPEN, REASON_MANUAL_OPEN, left)
        state = self._state
        if state is BreakerState.CLOSED:
            return BreakerVerdict(True, state)
        if state is BreakerState.OPEN:
            return BreakerVerdict(False, state, REASON_OPEN, self._open_until - now)
        if self._step < 0:
            if self._probe_since is None:
                self._probe_since = self._probe_last = now
                return BreakerVerdict(True, state)
        else:
            self._credit += cfg.ramp_steps[self._step]
            if self._credit >= 1.0 - _EPS:
                self._credit -= 1.0
                return BreakerVerdict(True, state)
        return BreakerVerdict(False, state, REASON_HALF_OPEN_THROTTLE, cfg.throttle_retry_after_s)

    def record(self, outcome: Outcome | str, latency_s: float | None, now: float) -> None:
        """Report one finished (or failed) request; record it as soon as it is known."""
        now = self._advance(now)
        outcome = Outcome(outcome)
        half_open = self._manual is None and self._state is BreakerState.HALF_OPEN
        if outcome in (Outcome.CLIENT_ERROR, Outcome.CANCELLED, Outcome.TENANT_FAILURE):
            if half_open and self._step < 0:
                # the probe proved nothing; let another go
                self._probe_since, self._probe_last = None, now
            return
        failed = outcome is Outcome.FAILURE
        slo = self.config.latency_slo_s
        slow = slo is not None and latency_s is not None and latency_s > slo
        if self._manual is not None or self._state is BreakerState.CLOSED:
            self._window.add(now, 1.0, float(failed), float(slow))
            self._consecutive = self._consecutive + 1 if failed else 0
            if self._manual is None:
                self._evaluate(now)
        elif half_open:
            if failed:
                self._trip(now, "half_open_failure")
            elif self._step < 0:
                self._probe_since, self._probe_last = None, now
                if slow:
                    self._trip(now, "half_open_slow")
                else:
                    self._probe_ok += 1
                    if self._probe_ok >= self.config.probe_successes:
                        self._start_step(0, now)
            else:
                self._step_seen[0] += 1
                self._step_seen[1] += int(slow)

    def probe_due(self, now: float) -> bool:
        """Half-open, waiting for a probe, and none has come for ``own_probe_after_s``: a probe
        of Sluice's own should go now (``allow`` it, then ``record`` how it went)."""
        now = self._advance(now)
        after = self.config.own_probe_after_s
        half_open = self._manual is None and self._state is BreakerState.HALF_OPEN
        waiting = half_open and self._step < 0 and self._probe_since is None
        return after > 0 and waiting and now - self._probe_last >= after - _EPS

    def record_success(self, now: float, latency_s: float | None = None) -> None:
        self.record(Outcome.SUCCESS, latency_s, now)

    def record_failure(self, now: float, latency_s: float | None = None) -> None:
        self.record(Outcome.FAILURE, latency_s, now)

    def observe_preemptions(self, total: float, now: float) -> bool:
        """Feed the backend's ``vllm:num_preemptions_total``; True when it tripped us.

        The first value is a baseline; a value lower than the last is a counter reset
        (backend restart): a new baseline, not a trip.
        """
        now = self._advance(now)
        last, self._last_preempt_total = self._last_preempt_total, total
        if last is None or total <= last or self._effective() is BreakerState.OPEN:
            return False  # baseline, reset, or the tail of a batch we already stopped feeding
        self._preempt.add(now, total - last)
        cfg = self.config
        if not cfg.trip_on_preemption or self._manual is not None:
            return False
        if self._preempt.prune(now)[0] >= cfg.preemption_threshold - _EPS:
            self._trip(now, "preemption")
            return True
        return False

    def trip(self, now: float, cause: str = "backend_oom") -> bool:
        """Open now for an outside reason (e.g. the backend reported OOM)."""
        now = self._advance(now)
        if self._manual is not None or self._state is BreakerState.OPEN:
            return False
        self._trip(now, cause)
        return True

    def set_manual(
        self,
        state: Literal["open", "closed"] | None,
        reason: str,
        until: float | None,
        now: float,
    ) -> None:
        """Force open/closed until ``until`` (None: until cleared); ``state=None`` clears."""
        now = self._advance(now)
        if state is None:
            if self._manual is not None:
                self._end_manual(now, "manual_cleared")
            return
        forced = BreakerState(state)
        if forced is BreakerState.HALF_OPEN:
            raise ValueError("manual state must be 'open' or 'closed'")
        if until is not None and until <= now:
            raise ValueError("manual override 'until' must be in the future")
        before = self._effective()
        self._manual = _Manual(forced, reason, until, now)
        self._emit(now, before, forced, f"manual_{forced}")

    def _effective(self) -> BreakerState:
        return self._manual.state if self._manual is not None else self._state

    def _phase(self) -> str | None:
        if self._manual is not None or self._state is not BreakerState.HALF_OPEN:
            return None
        return "probe" if self._step < 0 else "ramp"

    def _fraction(self) -> float:
        """Share of traffic the breaker currently lets through."""
        state = self._effective()
        if state is BreakerState.CLOSED:
            return 1.0
        if state is BreakerState.OPEN or self._step < 0:
            return 0.0
        return self.config.ramp_steps[self._step]

    def _cooldown(self) -> float:
        cfg = self.config
        return min(cfg.max_cooldown_s, cfg.cooldown_s * cfg.cooldown_multiplier**self._level)

    def _emit(self, at: float, src: BreakerState, dst: BreakerState, cause: str) -> None:
        self._events.append(BreakerEvent(at, src, dst, cause))
        if self.on_change is not None:
            self.on_change()

    def _enter(self, at: float, state: BreakerState, cause: str, src: BreakerState) -> None:
        self._state, self._since = state, at
        self._probe_since, self._probe_ok, self._step = None, 0, -1
        self._probe_last = at
        self._credit = 0.0
        if state is not BreakerState.CLOSED:
            self._preempt.clear()  # preemptions before a trip (or an override) are spent
        self._emit(at, src, state, cause)

    def _trip(self, at: float, cause: str) -> None:
        cooldown = self._cooldown()
        if cooldown < self.config.max_cooldown_s:
            self._level += 1
        self._trips += 1
        self._last_cause = cause
        self._open_until = at + cooldown
        self._window.clear()
        self._consecutive = 0
        self._enter(at, BreakerState.OPEN, cause, self._state)

    def _evaluate(self, now: float) -> None:
        cfg = self.config
        total, failed, slow = self._window.prune(now)
        if cfg.consecutive_failures and self._consecutive >= cfg.consecutive_failures:
            self._trip(now, "consecutive_failures")
        elif total >= cfg.min_requests and failed >= cfg.error_ratio * total - _EPS:
            self._trip(now, "error_ratio")
        elif (
            cfg.latency_slo_s is not None
            and total >= cfg.min_requests
            and slow >= cfg.latency_breach_ratio * total - _EPS
        ):
            self._trip(now, "latency_slo")

    def _start_step(self, step: int, at: float) -> None:
        self._step, self._step_start, self._step_seen = step, at, [0, 0]
        if self.on_change is not None:
            self.on_change()  # a step's end is a time a trip may fall due (next_change)

    def _end_manual(self, at: float, cause: str) -> None:
        m, self._manual = self._manual, None
        assert m is not None
        if m.state is BreakerState.OPEN:
            self._enter(at, BreakerState.HALF_OPEN, cause, m.state)
        else:
            self._enter(at, BreakerState.CLOSED, cause, m.state)
            self._evaluate(at)

    def _advance(self, now: float) -> float:
        """Apply every transition due by ``now``, each at the time it fell due."""
        now = self._now = max(now, self._now)
        while self._step_due(now):
            pass
        return now

    def _step_due(self, now: float) -> bool:
        """Make the one transition due by ``now``, if any; True if one was made."""
        cfg = self.config
        if (m := self._manual) is not None:
            if m.until is not None and now >= m.until:
                self._end_manual(m.until, "manual_expired")
                return True
            return False
        if self._state is BreakerState.CLOSED:
            if self._level and now - self._since >= cfg.cooldown_reset_s:
                self._level = 0
            return False
        if self._state is BreakerState.OPEN:
            if now < self._open_until:
                return False
            self._enter(self._open_until, BreakerState.HALF_OPEN, "cooldown_elapsed", self._state)
            return True
        if self._step < 0:
            if self._probe_since is not None and now - self._probe_since >= cfg.probe_timeout_s:
                self._probe_since, self._probe_last = None, self._probe_since + cfg.probe_timeout_s
            return False
        if now - self._step_start < cfg.ramp_step_s:
            return False
        due = self._step_start + cfg.ramp_step_s
        seen, slow = self._step_seen
        if cfg.latency_slo_s is not None and seen and slow >= cfg.latency_breach_ratio * seen:
            self._trip(due, "latency_slo")
        elif self._step + 1 >= len(cfg.ramp_steps):
            self._window.clear()
            self._consecutive = 0
            self._enter(due, BreakerState.CLOSED, "recovered", self._state)
        else:
            self._start_step(self._step + 1, due)
        return True
