"""`rollcall up` and the commands that operate it (add, kill, chaos, status,
report), end to end: real etcd, the real rendezvous service, real worker
processes, and the commands run as an operator would run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollcall.etcd_local import child_processes, free_port, pid_alive
from rollcall.local import kill_times
from tests.harness import ROOT, Process, wait_for

pytestmark = pytest.mark.integration  # starts processes

PATIENCE = 60.0


@dataclass
class Up:
    process: Process
    env: dict[str, str]
    events: Path
    metrics_port: int

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return rollcall(*argv, env=self.env, timeout=timeout)

    def status(self) -> dict[str, Any]:
        result = self.run("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def view_changes(self) -> list[dict[str, Any]]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        records = [json.loads(line) for line in lines if line.strip()]
        return [r for r in records if r["kind"] == "view_change"]


def rollcall(
    *argv: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollcall.cli", *argv], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def isolated_env(tmp: Path) -> dict[str, str]:
    """Commands that look for a local `up` look only at this test's."""
    runtime = tmp / "runtime"
    runtime.mkdir(exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}


def start_up(tmp: Path, workers: int, *extra: str) -> Up:
    env = isolated_env(tmp)
    events = tmp / "events.jsonl"
    port = free_port()
    argv = [
        sys.executable, "-m", "rollcall.cli", "up", "--workers", str(workers), "--no-live",
        "--events", str(events), "--data-dir", str(tmp / "up"), "--metrics-port", str(port),
        "--set", "member_lease_ttl=6", "--set", "takeover_grace=2", *extra,
    ]  # fmt: skip
    process = Process(argv, env, tmp / "up.log")
    process.wait_line(lambda line: "Ctrl-C stops everything" in line, PATIENCE)
    return Up(process, env, events, port)


def stop_up(up: Up) -> None:
    if up.process.proc.poll() is None:
        up.process.signal(signal.SIGINT)
        up.process.proc.wait(timeout=PATIENCE)


def members(up: Up) -> int:
    return len(up.status()["members"])


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cluster = start_up(tmp_path_factory.mktemp("up"), 3, "--steps", "100000")
    try:
        wait_for(lambda: members(cluster) == 3 and cluster.status()["step"], "3 members training")
        yield cluster
    finally:
        stop_up(cluster)


def test_status_finds_the_local_up_without_flags_and_training_advances(up: Up):
    first = up.status()
    assert first["job"] == "dev" and len(first["members"]) == 3
    wait_for(lambda: up.status()["step"] > first["step"] + 5, "the step to advance")


def test_up_hands_its_config_overrides_to_the_workers_it_starts(up: Up):
    commands = [psutil.Process(pid).cmdline() for pid in child_processes(up.process.pid)]
    workers = [command for command in commands if "worker" in command]
    assert workers, "no worker among up's children"
    for argv in workers:
        assert "--set=member_lease_ttl=6" in argv and "--set=takeover_grace=2" in argv, argv


def test_add_hot_adds_a_worker_that_joins_the_view(up: Up):
    before = members(up)
    result = up.run("add")
    assert result.returncode == 0 and "started" in result.stdout, result.stderr
    wait_for(lambda: members(up) == before + 1, "one more member")
    step = up.status()["step"]
    wait_for(lambda: up.status()["step"] > step, "training to go on with the new member")


def test_kill_random_is_recorded_as_a_view_change_with_its_stall(up: Up):
    wait_for(lambda: members(up) >= 3, "at least 3 members")
    before = members(up)
    result = up.run("kill", "--random")
    assert result.returncode == 0, result.stderr
    victim = result.stdout.split()[3]  # "sent SIGKILL to <member> (pid N)"
    wait_for(lambda: members(up) == before - 1, "the killed member to leave the view")

    def crash_event() -> dict[str, Any] | None:
        for event in up.view_changes():
            if victim in event["removed"] and event["stall_s"] is not None:
                return event
        return None

    event = wait_for(crash_event, "the crash's view change record")
    assert event["cause"] == "crash" and victim in event["members_before"]
    assert victim not in event["members_after"]
    assert all(event["phases"][p] is not None for p in event["phases"]), event
    assert 0 < event["stall_s"] < 30 and event["restart_cost_s"] > 0
    print(f"\nkill -> every survivor's next step: {event['stall_s'] * 1000:.0f} ms, {event}")


def test_metrics_endpoint_reports_the_view(up: Up):
    url = f"http://127.0.0.1:{up.metrics_port}/metrics"

    def metrics() -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def agreeing() -> dict[str, float] | None:
        """The metrics, once they agree with `rollcall status` (a view
        change may land between the two readings)."""
        values, status = metrics(), up.status()
        same = values["rollcall_view_epoch"] == status["epoch"]
        return values if same and values["rollcall_members"] == len(status["members"]) else None

    values = wait_for(agreeing, "metrics that match rollcall status")
    assert values["rollcall_leader"] == 1
    assert values["rollcall_committed_step"] > 0
    assert any(k.startswith("rollcall_stall_seconds_bucket") for k in values)


def test_chaos_kills_and_replaces_workers_within_its_bound(up: Up):
    started = time.monotonic()
    result = up.run(
        "chaos", "--mtbf", "1.5", "--duration", "4", "--seed", "7", "--rejoin-after", "1",
        "--min-workers", "2", timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    kills = int(summary.split()[1])
    assert kills >= 1 and f"{kills} rejoins" in summary, result.stdout
    assert elapsed < 4 + 1 + 15, "chaos must end after its duration plus the last rejoin"
    wait_for(lambda: members(up) >= 3, "the replacements to join")


def deployment_flags(up: Up) -> list[str]:
    """Address the `up` as a deployment would be addressed, with flags."""
    (record,) = [
        json.loads(path.read_text())
        for path in Path(up.env["XDG_RUNTIME_DIR"]).glob("rollcall/up-*.json")
    ]
    return ["--rendezvous", record["rendezvous"], "--job", record["job"],
            "--token-file", record["token_file"]]  # fmt: skip


def test_add_and_kill_against_a_deployment_by_address(up: Up, tmp_path: Path):
    flags = deployment_flags(up)
    before = {m["id"] for m in up.status()["members"]}
    result = up.run("add", *flags, "--log-dir", str(tmp_path))
    assert result.returncode == 0 and "started pid" in result.stdout, result.stderr
    pid = int(result.stdout.split()[2].rstrip(","))  # "started pid N, log PATH"
    try:
        joined = wait_for(
            lambda: {m["id"] for m in up.status()["members"]} - before, "the added worker to join"
        )
        (member,) = joined
        result = up.run("kill", member, *flags)
        assert result.returncode == 0 and f"SIGKILL to {member}" in result.stdout, result.stderr
        wait_for(lambda: member not in {m["id"] for m in up.status()["members"]}, "it to leave")
        assert list(tmp_path.glob("worker-*.log")), "the added worker's log"
    finally:
        if pid_alive(pid):  # detached from the test: it must not outlive a failure
            os.kill(pid, signal.SIGKILL)


def test_chaos_against_a_deployment_kills_its_local_members(up: Up):
    wait_for(lambda: members(up) >= 3, "at least 3 members")
    result = up.run(
        "chaos", *deployment_flags(up), "--mtbf", "1", "--duration", "2.5", "--seed", "3",
        "--min-workers", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "SIGKILL" in result.stdout and "0 rejoins" in result.stdout, result.stdout


def test_report_draws_the_run(up: Up, tmp_path: Path):
    output = tmp_path / "report.png"
    result = up.run("report", str(up.events), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in result.stdout


def test_chaos_schedule_is_reproducible_from_its_seed():
    assert kill_times(7, 1.5, 60) == kill_times(7, 1.5, 60)
    assert kill_times(7, 1.5, 60) != kill_times(8, 1.5, 60)
    times = kill_times(7, 1.5, 600)
    assert all(0 < t < 600 for t in times) and times == sorted(times)
    assert 300 < len(times) < 500  # ~ duration / mtbf = 400


def test_ctrl_c_stops_everything_up_started(tmp_path: Path):
    up = start_up(tmp_path, 2, "--steps", "100000")
    try:
        wait_for(lambda: members(up) == 2, "2 members")
        children = list(child_processes(up.process.pid))
        assert len(children) >= 3  # etcd and the workers
    finally:
        stop_up(up)
    assert up.process.proc.returncode == 0, up.process.log_tail()
    alive = [pid for pid in children if pid_alive(pid)]
    assert alive == [], f"left running: {alive}"
    assert not list((tmp_path / "runtime").glob("rollcall/up-*.json")), "discovery file left"


def test_up_ends_when_the_job_is_done(tmp_path: Path):
    up = start_up(tmp_path, 2, "--steps", "30")
    assert up.process.proc.wait(timeout=PATIENCE * 2) == 0, up.process.log_tail()
    summary = up.process.wait_line(
        lambda line: line.startswith("rollcall up:") and "view changes" in line, 5
    )
    assert "goodput" in summary, summary


@pytest.mark.parametrize(
    "argv, code, says",
    [
        (["kill", "--random"], 1, "no `rollcall up` is running"),
        (["add"], 1, "no `rollcall up` is running"),
        (["chaos", "--mtbf", "1", "--duration", "1"], 1, "no `rollcall up` is running"),
        (["status"], 1, "no `rollcall up` is running"),
        (["kill", "w0", "--random"], 2, "give either MEMBER or --random"),
        (["kill"], 2, "give either MEMBER or --random"),
        (["chaos", "--mtbf", "0", "--duration", "1"], 2, "--mtbf"),
        (["status", "--job", "dev"], 2, "--rendezvous and --job go together"),
        (["up", "--global-batch", "30", "--micro-batch", "8"], 2, "multiple of --micro-batch"),
        (["report", "/nonexistent/events.jsonl"], 1, "does not exist"),
    ],
)
def test_operator_commands_refuse_bad_input_in_one_line(tmp_path: Path, argv, code, says):
    result = rollcall(*argv, env=isolated_env(tmp_path))
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollcall: error:") and says in lines[0], lines


def test_checkpoints_list_finds_the_local_up_without_flags(up: Up):
    wait_for(lambda: up.status()["checkpoints"], "a first checkpoint (every 100 steps)")
    result = up.run("checkpoints", "list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("job dev: ") and "[present]" in result.stdout, result.stdout
