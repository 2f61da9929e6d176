"""Calendar periods in time zones (extproc.policy.period): contiguous, never overlapping,
aligned to local midnight (or the hour, minute, Monday, the 1st), through DST both ways."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.period import PERIODS, _compute, boundary, span_at

# Zones with the awkward cases: DST at 02:00 (New York, Berlin), at midnight (Santiago),
# a 30-minute DST shift (Lord Howe), half- and quarter-hour offsets (Kolkata, Kathmandu),
# a skipped date (Apia, 2011-12-30), southern-hemisphere DST (Sydney).
ZONES = ["UTC", "America/New_York", "Europe/Berlin", "America/Santiago", "Australia/Lord_Howe",
         "Asia/Kolkata", "Asia/Kathmandu", "Pacific/Apia", "Australia/Sydney", "Europe/London"]
WALLS = st.floats(min_value=datetime(1995, 1, 1, tzinfo=UTC).timestamp(),
                  max_value=datetime(2040, 1, 1, tzinfo=UTC).timestamp())


def at(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S")


@settings(max_examples=400, deadline=None)
@given(zone=st.sampled_from(ZONES), kind=st.sampled_from(PERIODS), wall=WALLS)
def test_a_period_holds_its_instant_and_meets_its_neighbours(zone: str, kind: str, wall: float) -> None:
    z = ZoneInfo(zone)
    s = _compute(kind, z, wall)
    assert s.start <= wall < s.end
    after = _compute(kind, z, s.end)
    assert after.start == s.end, "the next period starts where this one ends"
    assert after.label > s.label
    before = _compute(kind, z, s.start - 0.001)
    assert before.end == s.start, "the previous period ends where this one starts"
    assert _compute(kind, z, s.start) == s


@settings(max_examples=300, deadline=None)
@given(zone=st.sampled_from(ZONES), kind=st.sampled_from(("day", "week", "month")), wall=WALLS)
def test_a_calendar_period_starts_at_local_midnight_unless_the_clock_skipped_it(zone: str, kind: str,
                                                                               wall: float) -> None:
    z = ZoneInfo(zone)
    s = _compute(kind, z, wall)
    local = datetime.fromtimestamp(s.start, z)
    if (local.hour, local.minute) != (0, 0):
        # Midnight did not exist that day: the clock jumped over it, and the period starts
        # at the jump (the local time just before it is still the previous day).
        just_before = datetime.fromtimestamp(s.start - 1, z)
        assert just_before.date() < local.date() and (local.hour, local.minute) <= (1, 0)
    if kind == "week":
        assert local.weekday() == 0
    if kind == "month":
        assert local.day == 1
    hours = (s.end - s.start) / 3600
    if kind == "day" and zone != "Pacific/Apia":
        assert 23 <= hours <= 25


def test_dst_days_are_23_and_25_hours_in_new_york() -> None:
    z = ZoneInfo("America/New_York")
    spring = span_at("day", z, at("2024-03-10T12:00:00+00:00"))
    fall = span_at("day", z, at("2024-11-03T12:00:00+00:00"))
    assert (spring.label, (spring.end - spring.start) / 3600) == ("2024-03-10", 23)
    assert (fall.label, (fall.end - fall.start) / 3600) == ("2024-11-03", 25)
    assert utc(spring.start) == "2024-03-10T05:00:00" and utc(spring.end) == "2024-03-11T04:00:00"


def test_the_repeated_hour_belongs_to_its_first_pass() -> None:
    """01:00-02:00 happens twice on 2024-11-03 in New York: one period of two hours."""
    z = ZoneInfo("America/New_York")
    first, second = at("2024-11-03T05:30:00+00:00"), at("2024-11-03T06:30:00+00:00")
    a, b = span_at("hour", z, first), span_at("hour", z, second)
    assert a == b and a.label == "2024-11-03T01:00"
    assert utc(a.start) == "2024-11-03T05:00:00" and utc(a.end) == "2024-11-03T07:00:00"


def test_a_midnight_the_clock_skips_starts_the_day_when_it_resumes() -> None:
    """Santiago sprang forward at 00:00 on 2022-09-11 (to 01:00): that day starts at 04:00 UTC."""
    z = ZoneInfo("America/Santiago")
    s = span_at("day", z, at("2022-09-11T12:00:00+00:00"))
    assert s.label == "2022-09-11" and utc(s.start) == "2022-09-11T04:00:00"
    assert datetime.fromtimestamp(s.start, z).strftime("%H:%M") == "01:00"
    assert boundary(datetime(2022, 9, 11), z) == s.start


def test_a_date_the_zone_skipped_is_no_instant_s_period() -> None:
    """Samoa moved across the date line: 2011-12-30 never happened in Apia."""
    z = ZoneInfo("Pacific/Apia")
    last = span_at("day", z, at("2011-12-30T09:59:59+00:00"))
    first = span_at("day", z, at("2011-12-30T10:00:00+00:00"))
    assert (last.label, first.label) == ("2011-12-29", "2011-12-31")
    assert last.end == first.start


def test_half_hour_zones_start_their_hours_at_half_past_in_utc() -> None:
    s = span_at("hour", ZoneInfo("Asia/Kolkata"), at("2024-10-06T00:10:00+00:00"))
    assert utc(s.start) == "2024-10-05T23:30:00" and s.end - s.start == 3600


def test_weeks_start_on_monday_and_months_on_the_first() -> None:
    z = ZoneInfo("Europe/Berlin")
    w = span_at("week", z, at("2024-03-31T12:00:00+00:00"))  # a Sunday, the DST change
    assert w.label == "2024-W13" and datetime.fromtimestamp(w.start, z).strftime("%a %H:%M") == "Mon 00:00"
    assert (w.end - w.start) / 3600 == 167
    m = span_at("month", z, at("2024-12-15T12:00:00+00:00"))
    assert m.label == "2024-12" and datetime.fromtimestamp(m.end, z).strftime("%Y-%m-%d") == "2025-01-01"


def test_remaining_is_the_time_to_the_next_period() -> None:
    s = span_at("minute", UTC, 120.5)
    assert (s.start, s.end, s.remaining_s(120.5), s.remaining_s(500)) == (120, 180, 59.5, 0.0)


def test_an_unknown_period_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown period"):
        span_at("fortnight", UTC, 0.0)
