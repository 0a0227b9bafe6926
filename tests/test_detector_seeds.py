"""bench/detector_seeds.py pools detector_sweep runs per setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration  # starts processes


def _setting(name: str, lost: float, false_evictions: int, silent: float) -> dict[str, Any]:
    return {
        "detector": name,
        "goodput_lost": lost,
        "goodput_lost_one_device_per_worker": lost + 0.1,
        "false_evictions": false_evictions,
        "silent_stall_s": {"median": silent, "min": silent, "max": silent, "n": 2},
        "sigkill_stall_s": {"n": 0},
        "failures_not_recovered": 0,
    }


def _run(
    path: Path, seed: int, settings: list[dict[str, Any]], min_std: float | None = None
) -> Path:
    parameters: dict[str, Any] = {"seed": seed}
    if min_std is not None:
        parameters["adaptive_config"] = {
            "phi_threshold": 8.0, "phi_min_std": min_std, "max_silence": 2.0}  # fmt: skip
    path.write_text(json.dumps({"parameters": parameters, "settings": settings}))
    return path


def _pool(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/detector_seeds.py", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_setting_in_several_runs_is_pooled_and_rows_go_best_first(tmp_path: Path) -> None:
    one = _run(tmp_path / "1.json", 1, [_setting("fixed 1.5 s", 0.40, 2, 1.6),
                                        _setting("adaptive", 0.50, 8, 0.9)])  # fmt: skip
    two = _run(tmp_path / "2.json", 2, [_setting("fixed 1.5 s", 0.46, 4, 1.7)])
    out = tmp_path / "pooled.json"
    result = _pool(one, two, "--json", out, "--md", tmp_path / "pooled.md")
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["settings"]
    assert [row["detector"] for row in rows] == ["fixed 1.5 s", "adaptive"]
    fixed = rows[0]
    assert fixed["runs"] == 2 and fixed["seeds"] == [1, 2]
    assert fixed["false_evictions"] == [2, 4]
    assert "| fixed 1.5 s | 2 (1,2) | 43.0 (40.0-46.0) |" in result.stdout
    assert (tmp_path / "pooled.md").read_text() == result.stdout
    # By seed: the runs of one seed side by side, "-" where a setting did not run.
    assert "| fixed 1.5 s | 40.0 | 46.0 |" in result.stdout
    assert "| adaptive | 50.0 | - |" in result.stdout
    # A run without SIGKILL failures has no stall to pool: shown as "-".
    assert "| 0.90 (0.90-0.90) | - | 0 |" in result.stdout


def test_a_file_that_is_no_sweep_result_is_refused_by_name(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"settings": []}')
    result = _pool(bogus)
    assert result.returncode == 1
    assert str(bogus) in result.stderr and "not a detector_sweep result" in result.stderr


def test_adaptive_runs_pool_by_their_recorded_settings_not_by_name(tmp_path: Path) -> None:
    before = _run(tmp_path / "1.json", 1, [_setting("adaptive", 0.5, 8, 0.9)], min_std=0.1)
    after = _run(tmp_path / "2.json", 1, [_setting("adaptive", 0.4, 2, 1.6)], min_std=0.25)
    tuned = _run(tmp_path / "3.json", 2, [_setting("adaptive (phi_min_std=0.25)", 0.3, 1, 1.5)],
                 min_std=0.25)  # fmt: skip
    out = tmp_path / "pooled.json"
    result = _pool(before, after, tuned, "--json", out)
    assert result.returncode == 0, result.stderr
    runs = {row["detector"]: row["runs"] for row in json.loads(out.read_text())["settings"]}
    assert runs == {
        "adaptive (phi 8, min std 0.1 s, max silence 2 s)": 1,
        "adaptive (phi 8, min std 0.25 s, max silence 2 s)": 2,
    }
