"""The runtime's report channel to its supervisor (worker/report.py) on its
own, over a real socket pair: what it sends, that a missing or vanished
supervisor costs training nothing, and how `up` reads the reports
(ManagedWorker)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollcall.local import ManagedWorker
from rollcall.membership.checkpoint import ReplayCost
from rollcall.membership.errors import Evicted, Interrupted, NotAMember, ProgressLost
from rollcall.worker.checkpoint import CheckpointUnusable
from rollcall.worker.environment import ENV_REPORT_FD
from rollcall.worker.report import EndReason, SupervisorReport, end_reason


@dataclass
class FakeStep:
    """What the report reads of a committed ``rollcall.worker.runtime.Step``."""

    number: int
    epoch: int = 1
    rank: int = 0
    world_size: int = 2
    loss: float | None = 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the supervisor's end, the worker's end)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield ours, theirs
    ours.close()
    theirs.close()


def received(sock: socket.socket) -> list[dict[str, Any]]:
    """Every report waiting on the supervisor's end."""
    sock.setblocking(False)
    reports = []
    while True:
        try:
            message = sock.recv(65536)
        except BlockingIOError:
            return reports
        if not message:
            return reports
        assert message.endswith(b"\n") and message.count(b"\n") == 1, message
        reports.append(json.loads(message))


def fill(sock: socket.socket) -> int:
    """Send filler messages until the socket's buffer is full."""
    sock.setblocking(False)
    sent = 0
    while True:
        try:
            sock.send(b'{"event": "filler", "pad": "' + b"x" * 1000 + b'"}\n')
        except BlockingIOError:
            return sent
        sent += 1


def test_events_are_sent_as_one_json_line_each(pair):
    ours, theirs = pair
    clock = Clock()
    report = SupervisorReport(theirs, clock=clock)
    report.joined("w0-1a2b3c4d", "127.0.0.1:4000")
    report.step(FakeStep(0), 16)
    report.resumed(ReplayCost(s_done=120, s_ckpt=99, t_step=0.5, t_launch=2.0, t_load=0.1))
    report.done(199)
    report.ended(None)
    kinds = received(ours)
    assert [r["event"] for r in kinds] == ["joined", "step", "resumed", "done", "ended"]
    joined, step, resumed, done, ended = kinds
    assert joined == {"event": "joined", "member_id": "w0-1a2b3c4d", "pid": os.getpid(),
                      "address": "127.0.0.1:4000"}  # fmt: skip
    assert step == {"event": "step", "step": 0, "epoch": 1, "rank": 0, "world": 2, "loss": 0.5,
                    "samples_s": None}  # fmt: skip
    assert resumed["s_ckpt"] == 99 and resumed["replay_steps"] == 21
    assert resumed["replay_cost_s"] == pytest.approx(21 * 0.5 + 2.1)
    assert done == {"event": "done", "step": 199}
    assert ended == {"event": "ended", "why": "left", "message": ""}


def test_ended_closes_the_channel_and_is_sent_once(pair):
    ours, theirs = pair
    report = SupervisorReport(theirs)
    report.ended(RuntimeError("a bug in user code"))
    report.ended(None)
    report.done(5)
    assert received(ours) == [
        {"event": "ended", "why": "error", "message": "RuntimeError: a bug in user code"}
    ]
    ours.setblocking(True)
    assert ours.recv(100) == b"", "the worker's end is closed after ended"
    assert not report.enabled


def test_step_events_are_sent_at_most_every_interval_but_at_once_in_a_new_view(pair):
    ours, theirs = pair
    clock = Clock()
    report = SupervisorReport(theirs, step_interval=0.2, clock=clock)
    for number, at in [(0, 0.0), (1, 0.05), (2, 0.1), (3, 0.25)]:
        clock.now = 100.0 + at
        report.step(FakeStep(number), 16)
    clock.now = 100.26
    report.step(FakeStep(4, epoch=2, world_size=3), 16)
    steps = received(ours)
    assert [s["step"] for s in steps] == [0, 3, 4]
    # Steps 1-3 (48 samples) committed in the 0.25 s since the event of step 0.
    assert steps[1]["samples_s"] == pytest.approx(48 / 0.25)
    assert steps[2]["world"] == 3 and steps[2]["epoch"] == 2


def test_a_full_buffer_never_blocks_a_step_and_lifecycle_events_wait_in_order(pair):
    ours, theirs = pair
    clock = Clock()
    # A step that waited for room would wait the flush timeout: 2 s, far above
    # any scheduling hiccup of a loaded machine.
    report = SupervisorReport(theirs, flush_timeout=2.0, clock=clock)
    assert fill(theirs) > 0
    report.joined("w0-1a2b3c4d", "127.0.0.1:4000")
    slowest = 0.0
    for number in range(2000):
        clock.now += 1.0  # every one of them is due
        started = time.perf_counter()
        report.step(FakeStep(number), 16)
        slowest = max(slowest, time.perf_counter() - started)
    report.done(1999)
    assert slowest < 1.0, f"a step took {slowest:.3f} s with nobody reading"
    started = time.perf_counter()
    report.ended(None)
    assert time.perf_counter() - started < 2.0 + 1.5, "ended waits at most its flush timeout"
    # Nobody read, so the kept events were given up at ended: nothing after
    # the filler.
    arrived = [r["event"] for r in received(ours)]
    assert set(arrived) == {"filler"}, arrived


def test_kept_events_go_out_in_order_once_the_supervisor_reads_again(pair):
    ours, theirs = pair
    clock = Clock()
    report = SupervisorReport(theirs, clock=clock)
    filler = fill(theirs)
    report.joined("w0-1a2b3c4d", "127.0.0.1:4000")
    report.step(FakeStep(0), 16)  # no room: dropped
    assert len(received(ours)) == filler  # the supervisor catches up
    clock.now += 1.0
    report.step(FakeStep(1), 16)
    report.done(1)
    assert [(r["event"], r.get("step")) for r in received(ours)] == [
        ("joined", None), ("step", 1), ("done", 1),
    ]  # fmt: skip


def test_a_vanished_supervisor_disables_the_channel_quietly(pair, caplog):
    ours, theirs = pair
    report = SupervisorReport(theirs, clock=Clock())
    ours.close()
    with caplog.at_level(logging.DEBUG, logger="rollcall.report"):
        report.joined("w0-1a2b3c4d", "127.0.0.1:4000")
        report.step(FakeStep(0), 16)
        report.done(0)
        report.ended(None)
    assert not report.enabled
    records = [r for r in caplog.records if r.name == "rollcall.report"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG, records


def test_without_the_variable_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv(ENV_REPORT_FD, raising=False)
    report = SupervisorReport.from_env()
    assert not report.enabled
    report.joined("w0", "127.0.0.1:1")
    report.step(FakeStep(0), 16)
    report.ended(None)


def test_from_env_takes_the_socket_for_this_process_only(pair, monkeypatch):
    ours, theirs = pair
    fd = os.dup(theirs.fileno())
    monkeypatch.setenv(ENV_REPORT_FD, str(fd))
    report = SupervisorReport.from_env()
    assert report.enabled
    assert ENV_REPORT_FD not in os.environ, "a program it starts must not reuse the number"
    assert not os.get_inheritable(fd)
    report.done(3)
    report.ended(None)
    assert [r["event"] for r in received(ours)] == ["done", "ended"]


def test_from_env_refuses_what_is_not_a_seqpacket_socket_and_leaves_it_open(monkeypatch, caplog):
    read_end, write_end = os.pipe()
    stream, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for value in ["not-a-number", str(write_end), str(stream.fileno())]:
            monkeypatch.setenv(ENV_REPORT_FD, value)
            with caplog.at_level(logging.WARNING, logger="rollcall.report"):
                assert not SupervisorReport.from_env().enabled
        os.write(write_end, b"x")
        stream.send(b"x")
    finally:
        for closing in (stream, peer):
            closing.close()
        os.close(read_end)
        os.close(write_end)
    assert len([r for r in caplog.records if r.name == "rollcall.report"]) == 3


@pytest.mark.parametrize(
    "error, why",
    [
        (None, EndReason.LEFT),
        (Evicted("removed by the roll call of epoch 7"), EndReason.EVICTED),
        (CheckpointUnusable("ckpt-99: bad digest"), EndReason.CANNOT_RESUME),
        (ProgressLost("step 120 reached, no checkpoint"), EndReason.CANNOT_RESUME),
        (Interrupted(15, "SIGTERM: left the job"), EndReason.INTERRUPTED),
        (KeyboardInterrupt(), EndReason.INTERRUPTED),
        (SystemExit(0), EndReason.LEFT),
        (SystemExit(2), EndReason.ERROR),
        (NotAMember("gone"), EndReason.ERROR),
        (ValueError("bad shape"), EndReason.ERROR),
    ],
)
def test_the_exception_in_flight_names_why_the_runtime_ended(error, why):
    assert end_reason(error) is why


def managed(tmp_path: Path) -> ManagedWorker:
    return ManagedWorker(0, "w0", SimpleNamespace(pid=4242), tmp_path / "w0.log")  # type: ignore[arg-type]


def test_up_follows_a_worker_through_its_reports(tmp_path):
    worker = managed(tmp_path)
    joined = {"event": "joined", "member_id": "w0-1a2b", "pid": 1, "address": "127.0.0.1:1"}
    assert worker.apply(joined) is None
    assert (worker.state, worker.member_id) == ("joining", "w0-1a2b")
    worker.apply({"event": "step", "step": 7, "epoch": 2, "rank": 1, "world": 3, "loss": 1.0,
                  "samples_s": 250.0})  # fmt: skip
    assert (worker.state, worker.step, worker.rank, worker.world) == ("training", 7, 1, 3)
    notice = worker.apply({"event": "ended", "why": "evicted", "message": "Evicted: epoch 9"})
    assert worker.state == "evicted" and notice is not None and "Evicted: epoch 9" in notice
    assert str(worker.log_path) in notice
    assert worker.exited(3) is None and worker.state == "evicted" and not worker.alive


def test_up_names_an_exit_its_runtime_did_not_report(tmp_path):
    killed, crashed, finished = managed(tmp_path), managed(tmp_path), managed(tmp_path)
    assert "killed" in (killed.exited(-9) or "") and killed.state == "killed"
    assert crashed.exited(1) is not None and crashed.state == "exited 1"
    finished.apply({"event": "done", "step": 99})
    finished.apply({"event": "ended", "why": "left", "message": ""})
    assert finished.exited(0) is None and finished.state == "done" and finished.done
