"""The scripts of docs/porting.md run: the ordinary one on its own, and its
port under `rollcall up --workers 3 -- python docs/examples/elastic.py`
through `rollcall add` and `rollcall kill --random`. Real etcd, the real
rendezvous service, real worker processes.

The port runs with its STEPS cut from 300 to 150 (a copy of the script with
that one line changed): three copies, each with two loader processes, train
3-4 steps a second on 2 cores, and half the steps still leave the job
training well after the added copy joined and one was killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, wait_for
from tests.test_up import PATIENCE, members, start_up, stop_up

pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "docs" / "examples"
#: The port's step count, and the one its copy here runs.
STEPS, SHORT_STEPS = 300, 150


def test_the_ordinary_script_runs_as_it_is(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "plain.py")], cwd=tmp_path, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "step 250 loss" in result.stdout
    assert (tmp_path / "model.pt").exists()


def test_the_port_trains_under_up_while_a_worker_is_added_and_one_killed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = (EXAMPLES / "elastic.py").read_text()
    assert f"\nSTEPS = {STEPS}\n" in script
    short = tmp_path / "elastic.py"
    short.write_text(script.replace(f"\nSTEPS = {STEPS}\n", f"\nSTEPS = {SHORT_STEPS}\n"))
    command = f'cd "{out}" && exec "{sys.executable}" "{short}"'
    up = start_up(tmp_path, 3, "--", "sh", "-c", command)
    try:
        wait_for(lambda: members(up) == 3 and up.status()["step"], "3 members training")
        added = up.run("add")
        assert added.returncode == 0, added.stderr
        wait_for(lambda: members(up) == 4, "the added copy to join")
        killed = up.run("kill", "--random")
        assert killed.returncode == 0, killed.stderr
        wait_for(lambda: members(up) == 3, "the view to shrink")
        assert up.process.proc.wait(timeout=PATIENCE * 2) == 0, up.process.log_tail()
    finally:
        stop_up(up)
    logs = [path.read_text() for path in (tmp_path / "up" / "workers").glob("w*.log")]
    assert len(logs) == 4
    # Steps 0-149 evaluate every 50: the last evaluation is step 100's.
    assert sum("step 100 loss" in text for text in logs) == 1, "rank 0 evaluates, once"
    assert all("Traceback" not in text for text in logs)
    assert (out / "model.pt").exists()
    causes = {c["cause"] for c in up.view_changes()}
    assert "crash" in causes and "join" in causes
