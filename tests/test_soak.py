"""bench/soak.py, short: a seeded schedule of faults on hosts in network
namespaces ends with its fault matrix, zero invariant violations and
nothing left behind (the long run is a benchmark: bench/README.md). The
schedule of seed 10 begins with a worker that serves corrupt state ranges
to a joiner, each caught (the soak's own check of it went stale unseen for
days while the short soak ran no such fault), then an etcd stall (every
etcd member SIGSTOPped for 14 s, longer than the member leases): training
goes on through it and nobody is evicted. ``--min-episodes 2`` runs both
however loaded the machine is (on a loaded one the first fault once took
22 s, past the 15 s asked for, and no stall was drawn)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollcall.membership.config import Config
from tests.harness import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

KINDS = ("crash", "freeze", "slow_below", "etcd_stall", "corrupt_chunk")


def test_short_soak_reports_its_fault_matrix_with_zero_violations(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "bench/soak.py", "--duration", "15", "--seed", "10",
         "--kinds", ",".join(KINDS), "--etcd-stall", "14", "18", "--gap", "1",
         "--min-episodes", "2",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["violations"] == 0
    assert result["left_behind"] == []
    episodes = result["episodes"]
    assert episodes, "no fault was injected"
    counts = {kind: row["count"] for kind, row in result["faults"].items()}
    assert sum(counts.values()) == len(episodes)
    assert set(counts) >= {"crash", "partition", "quorum_loss", "corrupt_chunk"}
    for episode in episodes:
        assert episode["kind"] in KINDS
        assert episode["violations"] == []
        assert episode["false_evictions"] == []
        assert 0 < episode["stall_s"] < 30
    stalls = [e for e in episodes if e["kind"] == "etcd_stall"]
    assert stalls, "the schedule drew no etcd stall: choose a seed that does"
    for episode in stalls:
        # Longer than a member's etcd lease: etcd expires them all on thaw.
        assert float(episode["detail"].split()[0]) > Config().member_lease_ttl
        # Training went on through the stall: no gap as long as the stall.
        assert episode["stall_s"] < 5.0
    corrupt = [e for e in episodes if e["kind"] == "corrupt_chunk"]
    assert corrupt, "the schedule drew no corrupt_chunk: choose a seed that does"
    # Ranges were served corrupt (and caught: else the episode's violation).
    assert all(int(e["detail"].split("(")[1].split()[0]) > 0 for e in corrupt), corrupt
    assert "fault matrix (0 violations)" in done.stdout
    assert result["steps_committed"] > 0
