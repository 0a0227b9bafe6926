"""The `rollcall` command line as users meet it: help, one-line errors with
the right exit codes (never a traceback), `status --json`, and the local
`etcd` and `up` commands, which stop on Ctrl-C leaving nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rollcall.etcd_local import LocalEtcd, child_processes, free_port
from rollcall.etcd_local import pid_alive as alive
from rollcall.membership.config import Config
from rollcall.membership.errors import EtcdCredentialsRefused
from rollcall.rendezvous.etcd_auth import EtcdCredentials
from rollcall.rendezvous.store import EtcdStore
from tests.harness import ROOT, ControlPlane, Process

pytestmark = pytest.mark.integration  # starts processes

#: A command that fails must say so within this (they run against loopback).
QUICK = 10.0


def rollcall(
    *args: str, token: str | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run `python -m rollcall.cli ARGS`, with $ROLLCALL_TOKEN set to
    ``token`` (unset if None)."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLCALL_TOKEN"}
    if token is not None:
        env["ROLLCALL_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "rollcall.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure's only stderr line (and there is no traceback)."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rollcall: error: "), lines[0]
    return lines[0]


def listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) == 0


def interrupt(process: Process, timeout: float = 15.0) -> int:
    """Ctrl-C: SIGINT, then the exit code."""
    process.signal(signal.SIGINT)
    try:
        return process.proc.wait(timeout=timeout)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A replica with one member in the view."""
    with LocalEtcd() as etcd:
        plane = ControlPlane([etcd.endpoint], tmp_path_factory.mktemp("cli"))
        try:
            member = plane.add_member("cli")
            member.wait_event(
                lambda e: e["event"] == "view" and member.member_id in e["members"], 30
            )
            yield plane
        finally:
            plane.close()


def status_args(plane: ControlPlane, *extra: str) -> list[str]:
    return ["status", "--rendezvous", plane.addresses[0], "--job", plane.job, *extra]


# --- help and usage --------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [[], ["etcd"], ["rendezvous"], ["status"], ["up"], ["worker"]], ids=str
)
def test_help_of_every_command_exits_zero(command: Sequence[str]) -> None:
    result = rollcall(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: ")
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "hint"),
    [(["--bogus"], "rollcall"), (["status", "--bogus"], "rollcall status"),
     (["etcd", "--client-port", "many"], "rollcall etcd"), (["nonsense"], "rollcall"),
     # a subcommand's: at ff28420 the hint named 'rollcall list', no such command
     (["checkpoints", "list", "extra"], "rollcall checkpoints list")],
    ids=str,
)  # fmt: skip
def test_bad_usage_is_one_line_with_exit_2(args: Sequence[str], hint: str) -> None:
    result = rollcall(*args)
    line = one_error_line(result)
    assert result.returncode == 2
    assert line.endswith(f"(see '{hint} --help')"), line


def command_args(command: str) -> list[str]:
    """``command`` aimed at a port where nothing listens."""
    return {
        "status": ["status", "--rendezvous", f"127.0.0.1:{free_port()}", "--job", "j"],
        "rendezvous": [
            "rendezvous", "--etcd", f"http://127.0.0.1:{free_port()}",
            "--listen", "127.0.0.1:0", "--job", "j",
        ],
        "worker": ["worker", "--rendezvous", f"127.0.0.1:{free_port()}", "--job", "j"],
    }[command]  # fmt: skip


@pytest.mark.parametrize("command", ["rendezvous", "worker"])
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("no_such_field=1", "no_such_field=1"),
        ("phi_threshold=high", "phi_threshold needs a float"),
        ("rollcall_deadline=-1", "must be positive"),
        ("session_open_timeout=5", "session_open_timeout must be below takeover_grace"),
    ],
)
def test_bad_config_override_is_one_line_with_exit_2(command: str, setting: str, says: str) -> None:
    result = rollcall(*command_args(command), "--set", setting, token="t")
    line = one_error_line(result)
    assert result.returncode == 2
    assert says in line


@pytest.mark.parametrize("command", ["status", "rendezvous", "worker", "up", "add", "kill"])
@pytest.mark.parametrize("job", ["a/b", "", "-lead", "x" * 65, "caf\u00e9"])
def test_a_bad_job_name_is_refused_at_once_by_the_services_rules(command: str, job: str) -> None:
    args = {
        "up": ["up", "--workers", "0"],
        "add": ["add", "--rendezvous", f"127.0.0.1:{free_port()}"],
        "kill": ["kill", "--random", "--rendezvous", f"127.0.0.1:{free_port()}"],
    }.get(command) or [a for a in command_args(command) if a not in ("--job", "j")]
    started = time.monotonic()
    result = rollcall(*args, "--job", job, token="t")
    line = one_error_line(result)
    assert result.returncode == 2
    assert "--job" in line and "job name" in line, line
    assert time.monotonic() - started < QUICK


def test_worker_accepts_a_valid_config_override() -> None:
    # Past the override, the worker goes on to want its token.
    result = rollcall(*command_args("worker"), "--set", "fence_window=0.2")
    assert "ROLLCALL_TOKEN" in one_error_line(result)


def test_worker_takes_the_rendezvous_and_job_rollcall_up_puts_in_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `rollcall up -- rollcall worker ...`: at 3809eb2 the worker stopped at
    # "Missing option '--rendezvous'" though up had said where the job is.
    monkeypatch.setenv("ROLLCALL_RENDEZVOUS", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("ROLLCALL_JOB", "j")
    result = rollcall("worker")
    assert "ROLLCALL_TOKEN" in one_error_line(result)  # past both: it wants its token


def test_the_workers_ledger_path_takes_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # `rollcall up --workers 2 -- rollcall worker --ledger l.jsonl` gives
    # both workers one file, which the second finds locked and is refused
    # for: `--ledger 'l-{name}.jsonl'` gives each its own.
    from rollcall.cli.worker import ledger_path

    monkeypatch.setenv("ROLLCALL_NAME", "w1")
    assert ledger_path(Path("runs/l-{name}.jsonl"), None) == Path("runs/l-w1.jsonl")
    assert ledger_path(Path("l-{name}.jsonl"), "a") == Path("l-a.jsonl")
    assert ledger_path(Path("plain.jsonl"), None) == Path("plain.jsonl")
    monkeypatch.delenv("ROLLCALL_NAME")
    assert ledger_path(Path("l-{name}.jsonl"), None) == Path("l-w.jsonl")


@pytest.mark.parametrize("command", ["status", "rendezvous", "worker"])
def test_missing_token_is_one_line(command: str) -> None:
    result = rollcall(*command_args(command))
    line = one_error_line(result)
    assert result.returncode in (1, 2)
    assert "--token-file" in line and "ROLLCALL_TOKEN" in line


# --- status -------------------------------------------------------------------------


def test_status_with_a_wrong_token_is_one_line(job: ControlPlane, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text(job.token + "-not")
    result = rollcall(*status_args(job, "--token-file", str(wrong)))
    assert "token" in one_error_line(result)
    assert result.returncode == 1


def test_status_where_nothing_listens_gives_up_after_its_timeout() -> None:
    started = time.monotonic()
    result = rollcall(
        "status", "--rendezvous", f"127.0.0.1:{free_port()}", "--job", "j", "--timeout", "2",
        token="t",
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert "unavailable" in one_error_line(result)
    assert 2.0 <= elapsed < QUICK


def test_status_of_another_job_is_one_line(job: ControlPlane) -> None:
    result = rollcall(*status_args(job, "--job", "other-job"), token=job.token)
    assert "no such job 'other-job'" in one_error_line(result)


def test_status_json_has_epoch_members_leader_and_step(job: ControlPlane) -> None:
    result = rollcall(*status_args(job, "--json", "--token-file", str(job.token_file)))
    assert result.returncode == 0, result.stderr
    reported = json.loads(result.stdout)
    assert isinstance(reported["epoch"], int) and reported["epoch"] >= 1
    assert [m["id"] for m in reported["members"]] == [job.members[0].member_id]
    assert [m["rank"] for m in reported["members"]] == [0]
    assert reported["leader"] == job.addresses[0]
    assert reported["step"] is None or isinstance(reported["step"], int)


# --- rendezvous -------------------------------------------------------------------------


def test_rendezvous_without_etcd_fails_fast_with_one_line() -> None:
    started = time.monotonic()
    result = rollcall(
        "rendezvous", "--etcd", f"http://127.0.0.1:{free_port()}", "--listen", "127.0.0.1:0",
        "--job", "j", token="t", timeout=30,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    line = one_error_line(result)
    assert "etcd" in line and "unavailable" in line
    assert result.returncode == 1
    assert elapsed < QUICK


# --- etcd and up: until Ctrl-C ------------------------------------------------------------


def test_etcd_command_serves_until_ctrl_c_and_leaves_nothing(tmp_path: Path) -> None:
    process = Process(
        [sys.executable, "-m", "rollcall.cli", "etcd", "--client-port", "0", "--peer-port", "0"],
        None,
        tmp_path / "etcd-command.log",
    )
    try:
        ready = process.wait_line(lambda line: line.startswith("etcd ready at"), timeout=30)
        match = re.match(r"etcd ready at (\S+) \(data in (.+)\);", ready)
        assert match, ready
        endpoint, data_dir = match.group(1), Path(match.group(2))
        auth = process.wait_line(lambda line: "authentication: on" in line, timeout=5)
        password = Path(re.search(r"password in (\S+);", auth).group(1))  # type: ignore[union-attr]
        assert password == data_dir / "auth" / "rollcall.password"
        assert oct(password.stat().st_mode & 0o777) == "0o600"
        credentials = EtcdCredentials.from_file("rollcall", password)
        with EtcdStore([endpoint], "probe", Config(), credentials=credentials) as store:
            store.ping()
        with EtcdStore([endpoint], "probe", Config()) as store:
            with pytest.raises(EtcdCredentialsRefused):
                store.ping()
        etcd_pids = [pid for pid, name in child_processes(process.pid).items() if name == "etcd"]
        assert len(etcd_pids) == 1
    finally:
        code = interrupt(process)
    assert code == 0, process.log_tail()
    assert "etcd stopped" in process.log_tail()
    assert not alive(etcd_pids[0])
    assert not data_dir.exists()


def test_up_serves_a_job_until_ctrl_c_and_leaves_nothing(tmp_path: Path) -> None:
    process = Process(
        [sys.executable, "-m", "rollcall.cli", "up", "--job", "dev", "--data-dir", str(tmp_path)],
        {"ROLLCALL_TOKEN": ""},
        tmp_path / "up.log",
    )
    try:
        first = process.wait_line(lambda line: "rendezvous at" in line, timeout=30)
        address = re.search(r"rendezvous at (\S+),", first)
        token_line = process.wait_line(lambda line: "token file:" in line, timeout=5)
        token_file = token_line.split("token file:", 1)[1].strip()
        assert address, first
        result = rollcall(
            "status", "--rendezvous", address.group(1), "--job", "dev", "--json",
            "--token-file", token_file,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["epoch"] == 0
        started = child_processes(process.pid)
        assert "etcd" in started.values()
    finally:
        code = interrupt(process)
    assert code == 0, process.log_tail()
    assert "rollcall up: stopped" in process.log_tail()
    assert not [pid for pid in started if alive(pid)]
    assert not listening(address.group(1))
