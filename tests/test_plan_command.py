"""`rollcall plan`: a job's settings in, the recommended detector timeout and
checkpoint interval and the predicted goodput (with its breakdown) for
rollcall and for a restart-from-checkpoint launcher out; bad input is one
line on stderr and exit 2. Run through click's runner inside rollcall's own
error-handling group, with few simulated failures to stay fast."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from rollcall.cli.group import RollcallGroup
from rollcall.cli.plan import DURATION, SIZE, plan
from rollcall.planning.costs import costs_from_results
from rollcall.planning.plan import daly_s, interval_steps
from tests.test_simulate import crafted_results

FAST = ("--failures", "40")
JOB = ("--step", "2s", "--checkpoint-write", "20s", "--checkpoint-load", "1m", "--state", "2GB")


@pytest.fixture
def cli() -> click.Group:
    group = RollcallGroup(name="rollcall")
    group.add_command(plan)
    return group


def run_cli(cli: click.Group, *args: str) -> Result:
    return CliRunner().invoke(cli, ["plan", *args], prog_name="rollcall")


def column(output: str, label: str) -> tuple[str, str]:
    """The rollcall and launcher cells of the row starting with ``label``."""
    for line in output.splitlines():
        if line.startswith(label):
            cells = re.split(r"\s{2,}", line[len(label):].strip())
            return cells[0], cells[-1]
    raise AssertionError(f"no row {label!r} in:\n{output}")


def one_error_line(result: Result, code: int) -> str:
    assert result.exit_code == code, result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollcall: error: "), result.stderr
    assert "Traceback" not in result.output + result.stderr
    return lines[0]


def test_durations_and_sizes_take_units():
    assert DURATION.convert("7.9h", None, None) == pytest.approx(7.9 * 3600)
    assert DURATION.convert("500ms", None, None) == pytest.approx(0.5)
    assert DURATION.convert("2m", None, None) == 120.0
    assert DURATION.convert("2min", None, None) == 120.0
    assert DURATION.convert("1d", None, None) == 86400.0
    assert DURATION.convert("30", None, None) == 30.0
    assert SIZE.convert("20GB", None, None) == 20 * 10**9
    assert SIZE.convert("1.5GiB", None, None) == 3 * 2**29
    assert SIZE.convert("500MB", None, None) == 500 * 10**6
    assert SIZE.convert("1000", None, None) == 1000


def test_it_recommends_settings_and_predicts_goodput_for_both_systems(cli):
    result = run_cli(cli, "--ranks", "256", "--mtbf", "2h", *JOB, *FAST)
    assert result.exit_code == 0, result.output + result.stderr
    out = result.output
    assert "rollcall plan: 256 ranks, job MTBF 2 h" in out
    assert "launcher (torchrun-like)" in out
    for label in ("detector timeout", "checkpoint every", "predicted goodput"):
        column(out, label)
    # Goodput and the losses listed add up to the whole wall time.
    for index in (0, 1):
        goodput = float(column(out, "predicted goodput")[index])
        losses = [float(re.split(r"\s{2,}", line.strip())[1 + index])
                  for line in out.splitlines() if line.startswith("  lost to ")]  # fmt: skip
        assert len(losses) >= 4
        assert 0 < goodput < 1
        assert goodput + sum(losses) == pytest.approx(1.0, abs=0.0005 * (len(losses) + 1))
    # The launcher's interval is searched around Daly's (20 s writes, 2 h MTBF).
    steps = int(column(out, "checkpoint every")[1].split()[0].replace(",", ""))
    daly = interval_steps(daly_s(20.0, 7200.0), 2.0)
    assert daly / 4 <= steps <= daly * 4
    assert f"({interval_steps(120.0 * 20 ** 0.5, 2.0):,} / {daly:,} steps)" in out


def test_the_failure_rate_can_be_given_per_job_per_rank_or_per_hour(cli):
    per_job = run_cli(cli, "--ranks", "64", "--mtbf", "10h", *JOB, *FAST)
    per_rank = run_cli(cli, "--ranks", "64", "--rank-mtbf", "640h", *JOB, *FAST)
    per_hour = run_cli(cli, "--ranks", "64", "--failure-rate", str(1 / 640), *JOB, *FAST)
    assert per_job.exit_code == 0, per_job.stderr
    assert per_job.output == per_rank.output
    assert column(per_job.output, "predicted goodput") == \
        column(per_hour.output, "predicted goodput")  # fmt: skip


def test_the_same_seed_gives_the_same_answer_another_may_not(cli):
    a = run_cli(cli, "--ranks", "64", "--mtbf", "1h", *JOB, *FAST, "--seed", "3")
    b = run_cli(cli, "--ranks", "64", "--mtbf", "1h", *JOB, *FAST, "--seed", "3")
    c = run_cli(cli, "--ranks", "64", "--mtbf", "1h", *JOB, *FAST, "--seed", "4")
    assert a.output == b.output
    assert "(seed 3)" in a.output and "(seed 4)" in c.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give the failure rate exactly one way"),
        (("--mtbf", "2h", "--rank-mtbf", "500h"), "got --mtbf, --rank-mtbf"),
        (("--mtbf", "0s"), "--mtbf must be positive"),
        (("--mtbf", "2 fortnights"), "is not a duration"),
        (("--mtbf", "2h", "--silent-share", "1.5"), "--silent-share"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, args, message):
    result = run_cli(cli, "--ranks", "64", *args, *JOB, *FAST)
    assert message in one_error_line(result, 2)


def test_a_bad_size_or_rank_count_is_refused(cli):
    bad_state = ("--step", "2s", "--checkpoint-write", "20s", "--checkpoint-load", "1m",
                 "--state", "20XB")  # fmt: skip
    assert "is not a size" in one_error_line(run_cli(cli, "--ranks", "8", "--mtbf", "1h",
                                                     *bad_state), 2)  # fmt: skip
    assert "--ranks" in one_error_line(run_cli(cli, "--ranks", "0", "--mtbf", "1h", *JOB), 2)


def test_costs_can_come_from_a_directory_of_benchmark_results(cli, tmp_path: Path):
    for name, content in crafted_results().items():
        (tmp_path / name).write_text(json.dumps(content))
    result = run_cli(cli, "--ranks", "100", "--mtbf", "3h", *JOB, *FAST,
                     "--costs-from", str(tmp_path), "--show-costs")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert f"from the benchmark results in {tmp_path}" in result.output
    assert "[recovery.json: crash.detect_s.median]" in result.output
    # The crafted view-change runs stop at 64 members: 100 is an extrapolation.
    costs = costs_from_results(crafted_results())
    assert "roll call at 100 members" in result.output
    assert costs.rollcall.roll_call.extrapolated(100)
    assert "is extrapolated from" in result.output


def test_costs_from_an_incomplete_directory_fail_in_one_line(cli, tmp_path: Path):
    results = crafted_results()
    del results["peers.json"]
    for name, content in results.items():
        (tmp_path / name).write_text(json.dumps(content))
    result = run_cli(cli, "--ranks", "8", "--mtbf", "3h", *JOB, "--costs-from", str(tmp_path))
    assert "peers.json is missing" in one_error_line(result, 1)


def test_the_shipped_costs_name_their_runs(cli):
    result = run_cli(cli, "--ranks", "8", "--rank-mtbf", "8000h", *JOB, *FAST)
    assert result.exit_code == 0, result.stderr
    assert "(shipped with rollcall)" in result.output
    assert "is extrapolated" not in result.output  # 8 members were measured around
