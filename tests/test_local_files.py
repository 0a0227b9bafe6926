"""Local files as another user of the machine meets them (findings 11, 12,
13): the discovery directory and its records are this user's own or are
refused, what `up` and the service write is 0600 in 0700 directories, a
second `up` on one --data-dir is one line at once, and a worker started
with SIGINT ignored still stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollcall.local import discovery_dir, find_local
from rollcall.private import UnsafePath, create_private, private_directory
from tests.harness import ROOT, ControlPlane, ReplicaProcess, WorkerProcess, wait_for
from tests.test_up import PATIENCE, isolated_env, members, start_up, stop_up

#: A uid that is not ours (the tests run as root, which may chown to it).
OTHER_UID = 4242


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def no_runtime_env(tmp: Path) -> dict[str, str]:
    """No $XDG_RUNTIME_DIR: the discovery directory is $TMPDIR/rollcall-<uid>."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(tmp)
    return env


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /tmp (world-writable, sticky) as the discovery base."""
    import tempfile

    tmp_path.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return tmp_path


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_a_discovery_directory_another_user_created_is_refused(shared_tmp: Path):
    planted = shared_tmp / f"rollcall-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        discovery_dir()


def test_a_discovery_directory_others_may_write_is_refused(shared_tmp: Path):
    planted = shared_tmp / f"rollcall-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(UnsafePath, match="open to other users"):
        discovery_dir()


def test_the_discovery_directory_is_created_0700(shared_tmp: Path):
    assert mode(discovery_dir()) == 0o700


def test_private_files_are_created_0600_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        directory = private_directory(tmp_path / "a" / "b")
        create_private(directory / "f", "x")
    finally:
        os.umask(old)
    assert mode(directory) == 0o700 and mode(directory / "f") == 0o600


def record(listener: tuple[str, int], token_file: Path, pid: int) -> str:
    return json.dumps(
        {
            "pid": pid,
            "job": "dev",
            "rendezvous": f"{listener[0]}:{listener[1]}",
            "token_file": str(token_file),
            "control": "/nonexistent/control",
            "events": "/nonexistent/events",
            "etcd": "127.0.0.1:1",
            "workdir": "/nonexistent",
            "command": None,
        }  # fmt: skip
    )


class Listener:
    """A loopback listener that counts the connections made to it: the
    planted record's 'rendezvous', which would receive the token."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.connections = 0
        self.received = b""
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.settimeout(1)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass  # the connection itself is what the tests count
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()


def run_status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollcall.cli", "status"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give files away")
@pytest.mark.parametrize("planted", ["directory", "record", "process"])
def test_status_sends_no_token_to_a_planted_discovery_record(tmp_path: Path, planted: str):
    """Another user plants an `up-*.json` naming their own listener: in a
    directory they created first, as their own file in ours, or naming a
    process of theirs. Root's `rollcall status` (no flags) never connects."""
    tmp_path.chmod(0o1777)
    token_file = tmp_path / "token"
    token_file.write_text("the-real-token-7d1f")
    token_file.chmod(0o600)
    listener = Listener()
    try:
        base = tmp_path / f"rollcall-{os.getuid()}"
        base.mkdir(mode=0o700)
        pid = os.getpid()
        other = None
        if planted == "process":
            # A process of another user: a sleep that dropped to OTHER_UID.
            other = subprocess.Popen(
                ["sleep", "60"], user=OTHER_UID, group=OTHER_UID, extra_groups=[]
            )
            pid = other.pid
        path = base / f"up-{pid}.json"
        path.write_text(record(listener.address, token_file, pid))
        path.chmod(0o600)
        if planted == "directory":
            os.chown(base, OTHER_UID, OTHER_UID)
            os.chown(path, OTHER_UID, OTHER_UID)
        elif planted == "record":
            os.chown(path, OTHER_UID, OTHER_UID)
        try:
            result = run_status(no_runtime_env(tmp_path))
        finally:
            if other is not None:
                other.kill()
                other.wait()
        assert result.returncode == 1, result
        assert "Traceback" not in result.stderr, result.stderr
        error = result.stderr.strip().splitlines()[-1]
        if planted == "directory":
            assert error.startswith("rollcall: error: refusing the discovery directory"), error
        else:
            assert "no `rollcall up` is running" in error, result.stderr
            assert "ignored the discovery record" in result.stderr, result.stderr
        time.sleep(0.5)
        assert listener.connections == 0, listener.received
        assert b"the-real-token" not in listener.received
    finally:
        listener.close()


def test_a_malformed_discovery_record_is_ignored(shared_tmp: Path):
    base = discovery_dir()
    create_private(base / f"up-{os.getpid()}.json", "{not json")
    create_private(base / "up-1.json", json.dumps({"pid": "1", "job": "a/b"}))
    with pytest.raises(Exception, match="no `rollcall up` is running"):
        find_local()


@pytest.mark.integration
def test_up_files_are_private_and_a_second_up_on_its_data_dir_is_one_line(tmp_path: Path):
    """`up --data-dir` makes its directories 0700 and the token, events and
    worker logs 0600; a stale lock (its holder is dead) is taken over; a
    second `up` on the same --data-dir is refused in one line, at once."""
    data = tmp_path / "up"
    data.mkdir(mode=0o700)
    (data / "up.lock").write_text("999999999\n")  # left by an `up` that was killed
    first = start_up(tmp_path, 1, "--steps", "100000")
    try:
        wait_for(lambda: members(first) == 1, "1 member")
        assert (data / "up.lock").read_text().strip() == str(first.process.pid)
        env = isolated_env(tmp_path)
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "rollcall.cli", "up", "--workers", "1", "--no-live",
             "--data-dir", str(data)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - started
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 1, second.stderr
        assert len(lines) == 1 and lines[0].startswith("rollcall: error: another `rollcall up`")
        assert f"pid {first.process.pid}" in lines[0], lines
        assert took < 10, took
        logs = list(data.rglob("*.log"))
        assert logs, sorted(data.rglob("*"))
        for path in [data, data / "etcd", *(p.parent for p in logs)]:
            assert mode(path) == 0o700, path
        for path in [data / "token", data / "up.lock", first.events, *logs]:
            assert mode(path) == 0o600, path
        runtime = Path(env["XDG_RUNTIME_DIR"]) / "rollcall"
        assert mode(runtime) == 0o700
        for path in runtime.glob("up-*.json"):
            assert mode(path) == 0o600, path
    finally:
        stop_up(first)
    assert first.process.proc.returncode == 0, first.process.log_tail()


@pytest.mark.integration
def test_the_service_events_file_is_created_0600(etcd, tmp_path: Path):
    plane = ControlPlane([etcd.endpoint], tmp_path, events=True)
    try:
        assert plane.events is not None
        wait_for(plane.events.exists, "the events file")
        assert mode(plane.events) == 0o600
    finally:
        plane.close()


def test_worker_started_with_sigint_ignored_stops_on_ctrl_c(control_plane, tmp_path: Path):
    """A worker started from a non-interactive shell (`cmd &`) inherits
    SIGINT ignored; Ctrl-C (SIGINT) must stop it all the same."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child
    try:
        worker = WorkerProcess(control_plane, tmp_path / "w.log", steps=100000)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for(lambda: len(worker.steps()) >= 3, "training steps")
        worker.signal(signal.SIGINT)
        code = worker.proc.wait(timeout=PATIENCE)
    finally:
        if worker.proc.poll() is None:
            worker.kill()
    assert code in (0, 130), (code, worker.log_tail())


def test_rendezvous_started_with_sigint_ignored_stops_on_ctrl_c(etcd, tmp_path: Path):
    """The same for a command with no handler of its own (`rollcall
    rendezvous`): it puts back the default SIGINT handler it inherited
    ignored, so Ctrl-C ends it."""
    from rollcall.etcd_local import free_port

    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child
    try:
        replica = ReplicaProcess([etcd.endpoint], "job1", token, free_port(), tmp_path / "r.log")
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        replica.signal(signal.SIGINT)
        code = replica.proc.wait(timeout=PATIENCE)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if replica.proc.poll() is None:
            replica.kill()
    assert code is not None, "SIGINT did nothing: the replica ran on"
