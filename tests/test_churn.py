"""bench/churn.py, short: 300 view changes of lightweight members against a
real etcd (compacting every 2 s) and a real replica; etcd's database and the
replica's RSS, threads and fds stay within the bench's bounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_300_view_changes_keep_etcd_and_the_replica_bounded(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    argv = [sys.executable, str(ROOT / "bench/churn.py"), "--changes", "300", "--every", "30",
            "--compaction-retention", "2s", "--max-seconds", "120", "--json", str(out)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=170, cwd=ROOT)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["bounded"] and result["changes"] >= 300, result["failures"]
    samples = result["samples"]
    assert len(samples) >= 10
    # Compaction acts: without it the space in use grows with every change
    # (measured: 150 KiB after 150 changes, 270 KiB after 300) and never
    # falls. With it the space in use falls back after each compaction
    # (every 2 s here; the run's 300 changes took about 10 s on 2 cores on
    # 2026-12-02): a sawtooth. Its peaks and its floor move with the rate
    # of changes against the compaction period (a floor level with an early
    # peak was seen: 120 KiB both), so what is checked is the falls.
    in_use = [s["db_in_use"] for s in samples]
    falls = sum(later < earlier for earlier, later in zip(in_use, in_use[1:], strict=False))
    assert falls >= 2, in_use
