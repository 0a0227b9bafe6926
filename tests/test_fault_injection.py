"""worker/faults.py: the fault-injection switch of the fault-matrix tests."""

from __future__ import annotations

import pytest

from worker.faults import ENV, Faults


def test_no_faults_unless_named() -> None:
    assert Faults.parse("") == Faults()
    assert Faults().corrupt(b"abc") == b"abc"


def test_named_faults_are_parsed() -> None:
    assert Faults.parse(" corrupt_serves=3 ,") == Faults(corrupt_serves=3)


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "corrupt_serves=2")
    assert Faults.from_env().corrupt_serves == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("corupt_serves=1", "unknown fault 'corupt_serves=1'"),
        ("corrupt_serves", "unknown fault 'corrupt_serves'"),
        ("corrupt_serves=-1", "must be a whole number"),
        ("corrupt_serves=x", "must be a whole number"),
    ],
)
def test_a_misspelt_fault_is_an_error_not_silence(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Faults.parse(text)


def test_corruption_flips_one_byte_per_serve_until_used_up() -> None:
    faults = Faults(corrupt_serves=2)
    data = bytes(range(10))
    for _ in range(2):
        damaged = faults.corrupt(data)
        assert len(damaged) == len(data)
        assert sum(a != b for a, b in zip(damaged, data, strict=True)) == 1
    assert faults.corrupt_serves == 0
    assert faults.corrupt(data) == data
