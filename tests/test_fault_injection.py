"""worker/faults.py: the fault-injection switch of the fault-matrix tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollcall.worker.faults import ENV, Faults

pytestmark = pytest.mark.integration  # starts processes


def test_no_faults_unless_named() -> None:
    assert Faults.parse("") == Faults()
    assert Faults().corrupt(b"abc") == b"abc"


def test_named_faults_are_parsed() -> None:
    assert Faults.parse(" corrupt_serves=3 ,") == Faults(corrupt_serves=3)
    assert Faults.parse("slow_describes=1") == Faults(slow_describes=1)


def test_a_slow_describe_is_used_up() -> None:
    faults = Faults(slow_describes=2)
    assert [faults.slow_describe() for _ in range(3)] == [True, True, False]
    assert not Faults().slow_describe()


def test_a_slow_land_is_used_up() -> None:
    faults = Faults.parse("slow_lands=1")
    assert [faults.slow_land() for _ in range(2)] == [True, False]


def test_a_slow_build_is_used_up() -> None:
    faults = Faults.parse("slow_builds=1")
    assert [faults.slow_build() for _ in range(2)] == [True, False]


def test_a_held_state_is_used_up() -> None:
    faults = Faults.parse("held_states=1")
    assert [faults.held_state() for _ in range(2)] == [True, False]


def test_a_failed_leave_is_used_up() -> None:
    faults = Faults.parse("failed_leaves=1")
    assert [faults.failed_leave() for _ in range(2)] == [True, False]


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


def test_worker_with_a_misspelt_fault_stops_with_one_clear_line(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    done = subprocess.run(
        [sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", "127.0.0.1:9",
         "--job", "j", "--token-file", str(token)],
        capture_output=True, text=True, timeout=120, env={**os.environ, ENV: "corupt=1"},
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "rollcall: error: ROLLCALL_FAULTS: unknown fault 'corupt=1' "
        "(known: corrupt_serves, slow_describes, slow_answers, slow_lands, slow_builds, "
        "failed_leaves, diverge_steps, held_gather_exits, held_states, as name=count)"
    )
