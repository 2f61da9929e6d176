"""The store's breaker: the gauge follows it, false alarms do not flood the log."""

from __future__ import annotations

import logging

import pytest

from extproc.store.breaker import StoreBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_on_trip_closes_on_answer_and_logs_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    clock, seen = Clock(), []
    b = StoreBreaker(probe_s=0.05, on_change=seen.append, clock=clock)
    assert b.up and seen == [True]
    with caplog.at_level(logging.WARNING, "sluice.store"):
        for _ in range(20):  # short false alarms, 10 ms each
            b.trip("slow")
            assert not b.up and not b.probe_due(clock.now)
            clock.now += 0.01
            assert b.answered() and b.up
        assert b.trips == 20 and seen == [True] + [False, True] * 20
        assert len(caplog.records) == 1  # one line for all of them
        clock.now += 11
        b.trip("killed")
        assert b.probe_due(clock.now + 0.05)
        clock.now += 2
        b.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "19 alarms" not in lines[1] and "(20 alarms" in lines[1]
    assert "after 2.0s" in lines[2]
    assert not b.answered()  # already closed: nothing changes
