"""The back-off every retry loop waits with: initial, doubling, capped,
reset by progress; a pure sequence, so these tests never sleep."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.backoff import Backoff


def delays(backoff: Backoff, count: int) -> list[float]:
    return [backoff.next() for _ in range(count)]


def test_the_first_delay_is_the_initial_one_and_each_next_doubles() -> None:
    assert delays(Backoff(0.05, 10.0), 4) == [0.05, 0.1, 0.2, 0.4]


def test_the_delay_stops_growing_at_the_maximum() -> None:
    assert delays(Backoff(0.1, 1.0), 7) == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(0.1, 1.0)
    delays(backoff, 5)

    backoff.reset()

    assert delays(backoff, 2) == [0.1, 0.2]


def test_initial_equal_to_the_maximum_waits_the_same_every_time() -> None:
    assert delays(Backoff(1.0, 1.0), 3) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("initial", "maximum"),
    [(0.0, 1.0), (-0.1, 1.0), (2.0, 1.0), (math.nan, 1.0), (0.1, math.nan), (0.1, math.inf)],
)
def test_settings_that_cannot_make_a_back_off_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="0 < initial <= maximum"):
        Backoff(initial, maximum)


@given(
    initial=st.floats(min_value=1e-6, max_value=10.0),
    factor=st.floats(min_value=1.0, max_value=1e4),
    resets=st.lists(st.booleans(), max_size=60),
)
def test_every_delay_lies_between_initial_and_maximum_and_never_shrinks_without_reset(
    initial: float, factor: float, resets: list[bool]
) -> None:
    backoff = Backoff(initial, initial * factor)
    previous = 0.0
    for reset in resets:
        if reset:
            backoff.reset()
            previous = 0.0
        delay = backoff.next()
        assert backoff.initial <= delay <= backoff.maximum
        assert delay >= previous
        assert delay == backoff.maximum or delay == previous * 2 or previous == 0.0
        previous = delay
