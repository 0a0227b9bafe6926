"""The per-member limit on roll calls started by reports, and the log
throttle (membership/ratelimit.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.membership.ratelimit import Admission, LogThrottle, ReportLimiter


def test_a_member_may_start_burst_roll_calls_in_a_row() -> None:
    limiter = ReportLimiter(3, 5.0)

    taken = [limiter.take("a", 0.0) for _ in range(3)]

    assert taken == [Admission.TAKEN] * 3


def test_over_the_limit_the_first_refusal_is_flagged_and_the_rest_are_not() -> None:
    limiter = ReportLimiter(2, 5.0)
    limiter.take("a", 0.0), limiter.take("a", 0.0)

    assert limiter.take("a", 0.1) is Admission.REFUSED
    assert limiter.take("a", 0.2) is Admission.STILL_REFUSED
    assert limiter.take("a", 0.3) is Admission.STILL_REFUSED


def test_one_more_per_interval_after_the_burst() -> None:
    limiter = ReportLimiter(1, 5.0)
    limiter.take("a", 0.0)

    assert limiter.take("a", 4.9) is Admission.REFUSED
    assert limiter.take("a", 5.0) is Admission.TAKEN
    assert limiter.take("a", 5.1) is Admission.REFUSED, "a refusal after a taken one is flagged"


def test_a_quiet_member_gets_its_burst_back_but_no_more() -> None:
    limiter = ReportLimiter(2, 1.0)
    limiter.take("a", 0.0), limiter.take("a", 0.0)

    taken = [limiter.take("a", 100.0) for _ in range(3)]

    assert taken == [Admission.TAKEN, Admission.TAKEN, Admission.REFUSED]


def test_each_member_has_its_own_limit() -> None:
    limiter = ReportLimiter(1, 5.0)
    limiter.take("a", 0.0)

    assert limiter.take("b", 0.0) is Admission.TAKEN
    assert limiter.take("a", 0.0) is Admission.REFUSED


def test_forgotten_members_start_afresh_and_take_no_memory() -> None:
    limiter = ReportLimiter(1, 5.0)
    limiter.take("a", 0.0), limiter.take("b", 0.0)

    limiter.keep_only({"b"})

    assert "a" not in limiter and "b" in limiter
    assert limiter.take("a", 0.0) is Admission.TAKEN


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5),
    st.floats(0.1, 10.0),
    st.lists(st.floats(0.0, 0.5), min_size=1, max_size=200),
)
def test_a_flood_is_held_to_burst_plus_one_per_interval(
    burst: int, interval: float, gaps: list[float]
) -> None:
    limiter = ReportLimiter(burst, interval)
    now, taken = 0.0, 0
    for gap in gaps:
        now += gap
        taken += limiter.take("a", now) is Admission.TAKEN

    assert taken <= burst + now / interval + 1e-9


def test_a_throttled_log_says_the_first_event_at_once_and_counts_those_left_out() -> None:
    throttle = LogThrottle(60.0)

    seen = [throttle.due(t) for t in (0.0, 1.0, 2.0, 59.9, 60.0, 61.0, 200.0)]

    assert seen == [0, None, None, None, 3, None, 1]


def test_a_log_throttle_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval > 0"):
        LogThrottle(0.0)
