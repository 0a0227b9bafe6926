"""The switch interval a view change shortens (worker/switching.py): put back
as it was, and only once a step of the newest roll call's view commits."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from rollcall.worker.switching import SwitchInterval


@pytest.fixture(autouse=True)
def _interval_as_found() -> Iterator[None]:
    found = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(found)


def test_the_interval_is_short_from_a_roll_call_until_a_step_of_its_view_commits() -> None:
    switching = SwitchInterval(0.0005)
    switching.shorten(7)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    switching.shorten(8)  # a second roll call before the view was entered
    switching.committed(7)  # a step of the view being left, landing late
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    switching.committed(8)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    switching.committed(9)  # nothing to put back
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_shorter_interval_set_by_the_process_is_never_lengthened() -> None:
    sys.setswitchinterval(0.0001)
    set_by_the_process = sys.getswitchinterval()  # as the interpreter rounds it
    switching = SwitchInterval(0.0005)
    switching.shorten(3)
    assert sys.getswitchinterval() == set_by_the_process
    switching.restore()
    assert sys.getswitchinterval() == set_by_the_process
