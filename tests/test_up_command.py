"""`rollcall up -- COMMAND`: the user's own training script as the workers
(tests/programs/tiny_elastic.py, whose runtime finds the job in its
environment), operated by `status`, `add` and `kill` as the built-in
example is; and what `up` refuses before starting anything. Real etcd, the
real rendezvous service, real worker processes."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from rollcall.etcd_local import child_processes, pid_alive
from tests.harness import ROOT, wait_for
from tests.test_up import PATIENCE, Up, isolated_env, members, rollcall, start_up, stop_up

pytestmark = pytest.mark.integration  # starts processes

PROGRAM = ROOT / "tests" / "programs" / "tiny_elastic.py"
#: A quick command-line refusal (nothing is started) takes less than this.
QUICK = 10.0


def user_command(*args: str) -> list[str]:
    return ["--", sys.executable, str(PROGRAM), *args]


def member_ids(up: Up) -> list[str]:
    return [m["id"] for m in up.status()["members"]]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_user_script_trains_to_the_end_while_workers_are_added_and_killed(tmp_path: Path):
    steps = 500  # ~30 s at the script's pace: room for an add and a kill on a busy machine
    paused = tmp_path / "paused"  # removed once the kill is over: the rest goes at full pace
    paused.touch()
    pace = ("--pause", "0.05", "--pause-while", str(paused))
    up = start_up(tmp_path, 2, *user_command("--steps", str(steps), *pace))
    workdir = tmp_path / "up"
    try:
        wait_for(lambda: members(up) == 2 and up.status()["step"], "2 members training")
        text = up.run("status")
        assert text.returncode == 0 and "tiny_elastic.py" in text.stdout, text.stdout + text.stderr
        assert sorted(i.split("-")[0] for i in member_ids(up)) == ["w0", "w1"]  # ROLLCALL_NAME

        added = up.run("add")
        assert added.returncode == 0, added.stderr
        assert added.stdout.startswith("started w2: ") and "tiny_elastic.py" in added.stdout
        wait_for(lambda: members(up) == 3, "the added copy to join")
        assert any(i.startswith("w2-") for i in member_ids(up))

        killed = up.run("kill", "--random")
        assert killed.returncode == 0, killed.stderr
        victim = killed.stdout.split()[3]  # "sent SIGKILL to <member> (pid N)"
        wait_for(lambda: members(up) == 2, "the view to shrink")
        assert victim not in member_ids(up)
        after = up.status()["step"]
        wait_for(lambda: up.status()["step"] > after + 5, "the survivors to go on training")
        paused.unlink()

        assert up.process.proc.wait(timeout=PATIENCE * 2) == 0, up.process.log_tail()
    finally:
        stop_up(up)
    logs = {path.stem: path.read_text() for path in (workdir / "workers").glob("w*.log")}
    finished = [name for name, text in logs.items() if f"trained to step {steps - 1}" in text]
    assert sorted(logs) == ["w0", "w1", "w2"]
    assert len(finished) == 2 and victim.split("-")[0] not in finished, logs
    assert list((workdir / "checkpoints").glob("ckpt+*.rcs")), "ROLLCALL_CHECKPOINT_DIR unused"
    assert mode(workdir) == 0o700 and mode(workdir / "token") == 0o600
    report = up.run("report", str(up.events), "-o", str(tmp_path / "report.png"))
    assert report.returncode == 0 and "goodput" in report.stdout, report.stderr


@pytest.mark.parametrize(
    ("command", "said"),
    [
        # A bug in the script: every copy raises at step 2 (or, started late
        # on a busy machine, finds the state gone with the others and cannot
        # resume). At 216ccf9 `up` went on showing "members 0" until Ctrl-C.
        # The earliest error is the one said.
        (["--", sys.executable, str(PROGRAM), "--steps", "100", "--raise-at", "2"],
         ["RuntimeError: a bug in the script at step 2"]),
        # A script that fails before Elastic reports anything (a missing
        # module, a bad flag, an error at construction): at d731b02 `up`
        # said "w0 exited 1" and went on.
        (["--", sys.executable, "-c", "import rollcall_no_such_module"],
         ["exited 1 before its runtime reported",
          "ModuleNotFoundError: No module named 'rollcall_no_such_module'"]),
        # A command that ends at once with exit 0 and never builds Elastic
        # (the wrong script, a guard that returned early): at 1cecc27 `up`
        # said "w0 exited 0" and went on.
        (["--", sys.executable, "-c", "print('nothing to train')"],
         ["exited 0 without joining the job", "nothing to train"]),
    ],
    ids=["an error in the script", "an exit before the runtime", "no job joined"],
)  # fmt: skip
def test_up_ends_with_an_error_once_every_worker_ended_with_one(
    tmp_path: Path, command: list[str], said: list[str]
):
    # Nothing is left to train and nothing will be by itself.
    up = start_up(tmp_path, 2, *command)
    try:
        assert up.process.proc.wait(timeout=PATIENCE) != 0, up.process.log_tail()
    finally:
        stop_up(up)
    log = up.process.log_tail(40)
    assert "every worker ended with an error and none is left running" in log, log
    for words in said:
        assert words in log, log


def test_ctrl_c_stops_a_wrapped_command_and_the_training_process_it_started(tmp_path: Path):
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{PROGRAM}" "$@"\necho "exit $?"\n')
    wrapper.chmod(0o755)
    up = start_up(tmp_path, 2, "--", str(wrapper), "--steps", "100000", "--pause", "0.02")
    try:
        wait_for(lambda: members(up) == 2, "2 members")
        started = child_processes(up.process.pid).items()
        shells = [pid for pid, name in started if name == wrapper.name]  # comm: the script's
        trainers = [pid for shell in shells for pid in child_processes(shell)]
        assert len(shells) == 2 and len(trainers) == 2, (shells, trainers)
    finally:
        stop_up(up)
    assert up.process.proc.returncode == 0, up.process.log_tail()
    left = [pid for pid in shells + trainers if pid_alive(pid)]
    assert left == [], f"left running: {left}"
    # SIGINT reached the training processes themselves: they left the job
    # (a leave, not a crash detected after a SIGKILL).
    (last,) = [c for c in up.view_changes() if not c["members_after"]]
    assert last["cause"] == "leave", last
    assert not [c for c in up.view_changes() if c["cause"] == "crash"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--steps", "5"], "--steps"),
        (["--global-batch", "16", "--checkpoint-every", "3"], "--global-batch, --checkpoint-every"),
        (["--d-model", "8", "--layers", "1", "--micro-batch", "4"],
         "--micro-batch, --d-model, --layers"),
    ],
)  # fmt: skip
def test_example_flags_with_a_command_are_a_usage_error_naming_them(tmp_path, flags, named):
    result = rollcall("up", *flags, *user_command("--steps", "5"), env=isolated_env(tmp_path))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rollcall: error:") and named in line and "COMMAND" in line, line


@pytest.mark.parametrize(
    "program, says",
    [
        ("no-such-program-here", "no such command on PATH"),
        ("./no/such/file", "no such file"),
        (str(PROGRAM), "not executable"),  # a script without its x bit
    ],
)
def test_a_command_that_cannot_start_is_one_line_and_starts_nothing(tmp_path, program, says):
    data_dir = tmp_path / "up"
    result = rollcall(
        "up", "--no-live", "--data-dir", str(data_dir), "--", program, "--steps", "5",
        env=isolated_env(tmp_path), timeout=QUICK,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rollcall: error: cannot run") and says in line, line
    assert not data_dir.exists() and not list((tmp_path / "runtime").rglob("up-*.json"))


def test_a_data_dir_open_to_other_users_is_refused(tmp_path: Path):
    data_dir = tmp_path / "shared"
    data_dir.mkdir()
    data_dir.chmod(0o755)
    result = rollcall(
        "up", "--no-live", "--data-dir", str(data_dir), *user_command("--steps", "5"),
        env=isolated_env(tmp_path), timeout=QUICK,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "open to other users (mode 755)" in line and "chmod 700" in line, line
    assert list(data_dir.iterdir()) == [] and mode(data_dir) == 0o755


def test_the_discovery_record_names_the_command(tmp_path: Path):
    up = start_up(tmp_path, 0, *user_command("--steps", "5"))
    try:
        (path,) = wait_for(lambda: list((tmp_path / "runtime").rglob("up-*.json")), "the record")
        record = json.loads(path.read_text())
        assert record["command"] == [sys.executable, str(PROGRAM), "--steps", "5"]
    finally:
        stop_up(up)
