"""Ledger.rewind: a job that resumed from a checkpoint forgets the steps
after it, in memory and in the file, and records them again."""

from __future__ import annotations

from pathlib import Path

from rollcall.worker.ledger import Ledger


def test_rewind_drops_the_later_steps_from_memory_and_file_and_they_are_recorded_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for step in range(6):
        ledger.record(step, 1, 2, [2 * step, 2 * step + 1])
    assert ledger.rewind(3) == 2
    assert list(ledger.steps()) == [0, 1, 2, 3]
    assert list(Ledger.load(path).steps()) == [0, 1, 2, 3]
    ledger.record(4, 2, 2, [100, 101])
    assert Ledger.load(path).steps()[4] == (100, 101)
    assert ledger.rewind(10) == 0
    assert not path.with_name(path.name + ".rewind").exists()
