"""A local cluster on one machine: what ``rollcall up`` runs and operates.

:class:`LocalCluster` starts an embedded etcd (a child process), a
rendezvous replica (in this process) writing the events file, and worker
processes: copies of the built-in example, or of the user's command; it
takes operator commands (``add``, ``kill``, ``list``) on a Unix socket in
its work directory and advertises itself in a discovery file, so that
``rollcall add/kill/chaos/status`` on the same machine find it without
flags. ``stop`` ends every process it started.

Every worker runs in a session (and process group) of its own, with the
job's coordinates in its environment (``worker/environment.py``) and one end
of a report socket (``worker/report.py``) through which its runtime tells
the cluster its member id, state and step: the worker's output is its own
and goes to its log file.

The discovery files live in ``$XDG_RUNTIME_DIR/rollcall`` (or
``/tmp/rollcall-<uid>``, ``$TMPDIR`` for ``/tmp`` if set), one
``up-<pid>.json`` per running ``up``. A record names the token file that
``status`` and the other commands then send to the rendezvous address it
names, so both the directory and each record must be this user's own: a
directory that another user owns or may write is refused, and a record
that is not this user's, malformed, or names a process of another user is
ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcall.etcd_local import pid_alive
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest, RollcallError
from rollcall.private import (
    check_private,
    create_private,
    open_private_append,
    private_directory,
)
from rollcall.protocol.validation import check_address, check_id
from rollcall.protocol.wire import TOKEN_FILE_ENV
from rollcall.worker.environment import (
    ENV_CHECKPOINT_DIR,
    ENV_JOB,
    ENV_NAME,
    ENV_RENDEZVOUS,
    ENV_REPORT_FD,
)
from rollcall.worker.report import EndReason

log = logging.getLogger("rollcall.up")

#: Signals an operator may send to a worker.
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM,
           "INT": signal.SIGINT, "CONT": signal.SIGCONT}  # fmt: skip
#: A stopping worker gets this long to leave cleanly before SIGKILL.
STOP_GRACE = 15.0
#: After a worker exits, reports still buffered are read for this long.
REPORT_DRAIN = 2.0
#: Largest report message read (the runtime's are well below 2 KiB).
REPORT_MAX_BYTES = 65536
#: How a worker's end is shown when its runtime did not say (exit codes).
EXIT_STATES = {-signal.SIGKILL: "killed"}


class NoLocalCluster(RollcallError):
    """No ``rollcall up`` runs on this machine (or several do)."""


def discovery_dir() -> Path:
    """The directory of the discovery records, created 0700 if absent;
    refused (``UnsafePath``, one line) if another user owns it or others
    may enter it: whoever made it could plant a record that sends them
    the job token."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        base = Path(runtime) / "rollcall"
    else:
        base = Path(tempfile.gettempdir()) / f"rollcall-{os.getuid()}"
    return private_directory(base, "discovery directory")


#: The text fields of a discovery record that name files or sockets.
_RECORD_PATHS = ("token_file", "control", "events", "workdir")


def check_record(path: Path, record: Any) -> dict[str, Any]:
    """A discovery record as `up` writes it (``ValueError`` naming what is
    not): this user's own regular file, the fields with their types, a
    valid job name and rendezvous address, absolute paths."""
    check_private(path, "discovery record", directory=False)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    pid = record.get("pid")
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"pid {pid!r} is not a process id")
    try:
        check_id(str(record.get("job")), "job", Config())
        check_address(str(record.get("rendezvous")), Config())
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    for name in _RECORD_PATHS:
        value = record.get(name)
        if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
            raise ValueError(f"{name} is not an absolute path")
    command = record.get("command")
    if command is not None and not (
        isinstance(command, list) and all(isinstance(a, str) for a in command)
    ):
        raise ValueError("command is not a list of arguments")
    return record


def _process_owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def find_local() -> dict[str, Any]:
    """The discovery record of the one ``rollcall up`` running here."""
    found = []
    for path in sorted(discovery_dir().glob("up-*.json")):
        try:
            record = check_record(path, json.loads(path.read_text()))
        except FileNotFoundError:
            continue  # its `up` has just ended
        except (OSError, ValueError) as exc:
            log.warning("ignored the discovery record %s: %s", path, exc)
            continue
        if not pid_alive(record["pid"]):
            path.unlink(missing_ok=True)  # left behind by an `up` that was killed
        elif _process_owner(record["pid"]) != os.getuid():
            log.warning("ignored the discovery record %s: its process is not this user's", path)
        else:
            found.append(record)
    if not found:
        raise NoLocalCluster(
            "no `rollcall up` is running on this machine; start one, or pass "
            "--rendezvous HOST:PORT and --job NAME"
        )
    if len(found) > 1:
        pids = ", ".join(str(r["pid"]) for r in found)
        raise NoLocalCluster(
            f"several `rollcall up` run here (pids {pids}); pass --rendezvous and --job"
        )
    return found[0]


async def control(record: dict[str, Any], request: dict[str, Any], timeout: float = 30) -> Any:
    """Send one command to a running ``up`` and return its answer."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(record["control"]), timeout
        )
    except (OSError, TimeoutError) as exc:
        raise NoLocalCluster(f"cannot reach `rollcall up` (pid {record['pid']}): {exc}") from None
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line:
        raise NoLocalCluster(f"`rollcall up` (pid {record['pid']}) closed the connection")
    answer = json.loads(line)
    if not answer.get("ok"):
        raise RollcallError(answer.get("error", "command failed"))
    return answer


@dataclass
class ManagedWorker:
    """One worker process started by the cluster, as its reports show it."""

    index: int
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    member_id: str | None = None
    state: str = "starting"
    step: int | None = None
    epoch: int | None = None
    rank: int | None = None
    world: int | None = None
    samples_s: float | None = None
    exit_code: int | None = None
    done: bool = False
    #: The ``why`` of its ``ended`` report, once received.
    ended: str | None = None
    #: What the operator was told of an ``ended`` report other than "left",
    #: and when (``time.monotonic()``).
    error_line: str | None = None
    error_at: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def label(self) -> str:
        return self.member_id or self.name

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "member_id": self.member_id, "pid": self.pid,
            "state": self.state, "step": self.step, "epoch": self.epoch, "rank": self.rank,
            "world": self.world, "exit_code": self.exit_code, "log": str(self.log_path),
        }  # fmt: skip

    def apply(self, report: dict[str, Any]) -> str | None:
        """Take one report of its runtime (``worker/report.py``); returns a
        line worth telling the operator, if any."""
        kind = report.get("event")
        if kind == "joined":
            self.member_id = str(report["member_id"])
            self.state = "joining"
        elif kind == "step":
            self.done = False  # a later job.steps() call trains on
            if self.state != "frozen":
                self.state = "training"
            self.step, self.epoch = int(report["step"]), int(report["epoch"])
            self.rank, self.world = int(report["rank"]), int(report["world"])
            self.samples_s = report.get("samples_s")
        elif kind == "resumed":
            return (
                f"{self.label} resumed from the checkpoint of step {report['s_ckpt']}: replay "
                f"cost {float(report['replay_cost_s']):.1f} s"
            )
        elif kind == "done":
            self.done = True
            self.state = "done"
            self.step = int(report["step"])
        elif kind == "ended":
            self.ended = str(report["why"])
            if not self.done:
                self.state = self.ended
            if self.ended != "left":
                message = str(report.get("message") or "")[:300]
                return self._error(f"ended ({self.ended}): {message}")
        return None

    def _error(self, what: str) -> str:
        """Note the error it ended with, and when; the operator's line."""
        self.error_line = f"{self.label} {what}  log: {self.log_path}"
        self.error_at = time.monotonic()
        return self.error_line

    def exited(self, code: int) -> str | None:
        """Its process ended with ``code``; returns a line worth telling
        the operator, if its runtime said nothing of it."""
        self.exit_code = code
        if self.done:
            self.state = "done" if code == 0 else f"done, exited {code}"
        elif self.ended is not None and self.ended != "left":
            return None  # told by its ended report
        elif self.ended == "left" and code == 0:
            self.state = "left"
        elif self.ended is None and 0 <= code < 128:
            # An exception before its runtime could report one (a missing
            # module, a bad flag, an error at construction), or a command
            # that never built Elastic; a signal gives a negative code, or
            # 128 + its number through a shell.
            self.state = f"exited {code}"
            self.ended = EndReason.ERROR
            how = (
                "without joining the job (does the command build rollcall.Elastic?)"
                if code == 0 and self.member_id is None
                else "before its runtime reported why"
            )
            return self._error(f"exited {code} {how}: {last_line(self.log_path)}")
        else:
            self.state = EXIT_STATES.get(code, f"exited {code}")
            return f"{self.label} {self.state}  log: {self.log_path}"
        return None


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of the log at ``path`` (what an uncaught
    exception printed last), at most ``limit`` characters."""
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 8192))
            tail = log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(its log cannot be read: {exc.strerror})"
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else "(its log is empty)"


@dataclass(frozen=True)
class WorkerOptions:
    """What the cluster's workers run: the built-in example (``command``
    empty; ``steps`` and ``worker_args`` are its flags) or the user's
    ``command``, started as it is."""

    steps: int | None = None
    worker_args: Sequence[str] = ()
    command: Sequence[str] = ()

    @property
    def label(self) -> str:
        return shlex.join(self.command) if self.command else "the built-in example"


def signal_group(worker: ManagedWorker, sig: int) -> None:
    """Signal the worker's whole process group: a command that is a wrapper
    (a shell script, a launcher) must not leave its training process
    behind."""
    os.killpg(worker.pid, sig)


class LocalCluster:
    """etcd + one rendezvous replica + workers, on loopback."""

    def __init__(
        self,
        workdir: Path,
        job: str,
        token_file: Path,
        rendezvous: str,
        etcd: str,
        events: Path,
        workers: WorkerOptions,
    ) -> None:
        self.workdir = workdir
        self.job = job
        self.token_file = token_file
        self.rendezvous = rendezvous
        self.etcd = etcd
        self.events = events
        self.options = workers
        self.workers: list[ManagedWorker] = []
        #: Lines for the operator (a resume, a worker ending), oldest first.
        self.notices: list[str] = []
        self.started = time.time()
        self._starting = asyncio.Lock()  # names follow the order of starts
        self._server: asyncio.AbstractServer | None = None
        self._discovery: Path | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self.control_path = workdir / "control.sock"

    # --- lifecycle -----------------------------------------------------------

    async def open_control(self) -> None:
        self.control_path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.control_path))
        self.control_path.chmod(0o600)
        self._discovery = discovery_dir() / f"up-{os.getpid()}.json"
        create_private(
            self._discovery,
            json.dumps(
                {
                    "pid": os.getpid(), "job": self.job, "rendezvous": self.rendezvous,
                    "token_file": str(self.token_file), "control": str(self.control_path),
                    "events": str(self.events), "etcd": self.etcd,
                    "workdir": str(self.workdir), "command": list(self.options.command) or None,
                }  # fmt: skip
            ),
        )

    async def stop(self) -> None:
        """Stop every worker (Ctrl-C first, so they leave cleanly; SIGKILL
        after ``STOP_GRACE``), and the control socket."""
        if self._server is not None:
            self._server.close()
        if self._discovery is not None:
            self._discovery.unlink(missing_ok=True)
        for worker in self.workers:
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    signal_group(worker, signal.SIGCONT)  # a frozen worker must wake to leave
                    signal_group(worker, signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.proc.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    signal_group(worker, signal.SIGKILL)
                await worker.proc.wait()
        # The followers kill what a worker left in its group and read its
        # last reports, within REPORT_DRAIN.
        if self._readers:
            await asyncio.wait(list(self._readers), timeout=REPORT_DRAIN + 1)
        for task in list(self._readers):
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self.control_path.unlink(missing_ok=True)

    @property
    def finished(self) -> bool:
        """Some worker reached the last step and no worker is left running."""
        return any(w.done for w in self.workers) and not any(w.alive for w in self.workers)

    @property
    def failed(self) -> str | None:
        """When every worker started has ended with an error its runtime
        reported (an exception in the script or the runtime, or no state to
        resume from), or exited with a code below 128 without reporting its
        end (``ManagedWorker.exited``), and none is left running, the earliest
        such error (the others may follow from it: a worker that joins after
        the last holder of the state died cannot resume): the job cannot go
        on by itself.
        None otherwise (a worker killed or stopped by a signal leaves room
        for `rollcall add`)."""
        ended = [w for w in self.workers if not w.alive]
        if not self.workers or len(ended) < len(self.workers):
            return None
        fatal = (EndReason.ERROR, EndReason.CANNOT_RESUME)
        if any(w.done or w.ended not in fatal for w in ended):
            return None
        return min(ended, key=lambda w: w.error_at).error_line

    # --- workers ---------------------------------------------------------------

    async def add(self, count: int = 1) -> list[ManagedWorker]:
        """Start ``count`` more workers (named w0, w1, ... in start order).
        Raises ``RollcallError`` if the command cannot be started."""
        added = []
        async with self._starting:
            for _ in range(count):
                added.append(await self._start_worker())
        return added

    async def _start_worker(self) -> ManagedWorker:
        index = len(self.workers)
        name = f"w{index}"
        log_path = self.workdir / "workers" / f"{name}.log"
        log_path.parent.mkdir(mode=0o700, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = self._argv(name)
        try:
            with open_private_append(log_path, binary=True) as output:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=output, stderr=output, stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True, env=self._environment(name, theirs.fileno()),
                    pass_fds=(theirs.fileno(),),
                )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise RollcallError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        finally:
            theirs.close()  # the worker holds its end; EOF on ours when it is gone
        worker = ManagedWorker(index, name, proc, log_path)
        self.workers.append(worker)
        task = asyncio.create_task(self._follow(worker, ours), name=f"follow-{name}")
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
        return worker

    def _argv(self, name: str) -> list[str]:
        if self.options.command:
            return list(self.options.command)
        return [
            sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", self.rendezvous,
            "--job", self.job, "--token-file", str(self.token_file), "--name", name,
            "--steps", str(self.options.steps), "--checkpoint-dir", str(self.checkpoints),
            "--log-level", "info", *self.options.worker_args,
        ]  # fmt: skip

    def _environment(self, name: str, report_fd: int) -> dict[str, str]:
        """The job's coordinates, for a runtime constructed without them."""
        return {
            **os.environ, ENV_RENDEZVOUS: self.rendezvous, ENV_JOB: self.job,
            TOKEN_FILE_ENV: str(self.token_file), ENV_NAME: name,
            ENV_CHECKPOINT_DIR: str(self.checkpoints), ENV_REPORT_FD: str(report_fd),
        }  # fmt: skip

    @property
    def checkpoints(self) -> Path:
        return self.workdir / "checkpoints"

    def find(self, member: str) -> ManagedWorker:
        for worker in self.workers:
            if member in (worker.member_id, worker.name, str(worker.pid)) and worker.alive:
                return worker
        raise RollcallError(f"no running worker {member!r} in this cluster")

    def kill(self, member: str | None, sig: str) -> ManagedWorker:
        """Send ``sig`` to a worker (``member`` id, name or pid; None: a
        random training worker)."""
        if sig not in SIGNALS:
            raise RollcallError(f"unknown signal {sig!r}; one of {', '.join(SIGNALS)}")
        if member is None:
            candidates = [w for w in self.workers if w.alive and w.state == "training"]
            if not candidates:
                raise RollcallError("no training worker to kill")
            worker = random.choice(candidates)
        else:
            worker = self.find(member)
        try:
            signal_group(worker, SIGNALS[sig])
        except ProcessLookupError:
            raise RollcallError(f"{worker.label} (pid {worker.pid}) has just exited") from None
        if sig == "STOP":
            worker.state = "frozen"
        elif sig == "CONT" and worker.state == "frozen":
            worker.state = "training"
        log.info("sent SIG%s to %s (pid %d)", sig, worker.label, worker.pid)
        return worker

    async def _follow(self, worker: ManagedWorker, channel: socket.socket) -> None:
        """Follow a worker's reports until its process has ended."""
        reading = asyncio.create_task(self._read_reports(worker, channel))
        try:
            code = await worker.proc.wait()
            # What the worker left in its process group goes with it (and
            # releases the report socket, if a child inherited it).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal_group(worker, signal.SIGKILL)
            await asyncio.wait({reading}, timeout=REPORT_DRAIN)
            self._notice(worker.exited(code))
        finally:
            reading.cancel()
            channel.close()

    async def _read_reports(self, worker: ManagedWorker, channel: socket.socket) -> None:
        """One JSON object per message; a malformed one is skipped."""
        channel.setblocking(False)
        loop = asyncio.get_running_loop()
        while True:
            try:
                message = await loop.sock_recv(channel, REPORT_MAX_BYTES)
            except OSError as exc:  # reset by a dying worker: nothing more will come
                log.debug("%s: report socket: %s", worker.name, exc)
                return
            if not message:
                return
            try:
                report = json.loads(message)
                self._notice(worker.apply(report))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("%s: malformed report %r: %s", worker.name, message[:200], exc)

    def _notice(self, line: str | None) -> None:
        if line is not None:
            log.info("%s", line)
            self.notices.append(line)

    # --- operator commands ----------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                request = json.loads(line)
                answer = await self._handle(request)
            except (ValueError, KeyError, TypeError) as exc:
                answer = {"ok": False, "error": f"bad request: {exc}"}
            except RollcallError as exc:
                answer = {"ok": False, "error": str(exc)}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    async def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "add":
            count = int(request.get("count", 1))
            if not 1 <= count <= 64:
                raise RollcallError("count must be between 1 and 64")
            added = await self.add(count)
            return {
                "ok": True, "workers": [w.describe() for w in added],
                "command": self.options.label,
            }  # fmt: skip
        if op == "kill":
            worker = self.kill(request.get("member"), str(request.get("signal", "KILL")))
            return {"ok": True, "worker": worker.describe()}
        if op == "list":
            return {"ok": True, "workers": [w.describe() for w in self.workers]}
        raise RollcallError(f"unknown command {op!r}")


#: The last summary per events file, with the (size, mtime) it was made from:
#: the live view asks twice a second, the file changes about once a second.
_summaries: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}


def summarize(events: Path) -> dict[str, Any]:
    """The run so far, from its events file (docs/events.md): its view
    changes (``rollcall.report.run.ViewChange``) and the goodput as ``rollcall
    report`` computes it (None before there is any). Parsed again only when
    the file has changed."""
    from rollcall.report.run import ReportError, goodput, read_events

    empty: dict[str, Any] = {"view_changes": (), "goodput": None}
    try:
        stat = events.stat()
    except OSError:
        return empty
    version = (stat.st_size, stat.st_mtime_ns)
    cached = _summaries.get(events)
    if cached is not None and cached[0] == version:
        return cached[1]
    try:
        run = read_events(events)
    except ReportError:
        return empty
    summary = {"view_changes": run.view_changes, "goodput": goodput(run).fraction}
    _summaries[events] = (version, summary)
    return summary


def pid_listening(address: str) -> int | None:
    """The pid of the process on this machine listening at ``address``
    (``host:port``), or None if none here does (the member runs elsewhere)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        output = subprocess.run(
            ["ss", "-Hltnp", f"sport = :{int(port)}"], capture_output=True, text=True,
            timeout=10, check=False,
        ).stdout  # fmt: skip
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    for line in output.splitlines():
        fields = line.split()
        local = fields[3] if len(fields) > 3 else ""
        listen_host = local.rpartition(":")[0].strip("[]").removeprefix("::ffff:")
        if listen_host not in (host, "0.0.0.0", "*", "::"):
            continue
        found = re.search(r"pid=(\d+)", line)
        if found:
            return int(found.group(1))
    return None


def kill_times(seed: int, mtbf: float, duration: float) -> list[float]:
    """When chaos kills, in seconds from its start: a Poisson process of
    rate ``1 / mtbf`` cut at ``duration``. Same seed, same times."""
    rng = random.Random(f"kill-times-{seed}")
    times, at = [], rng.expovariate(1 / mtbf)
    while at < duration:
        times.append(at)
        at += rng.expovariate(1 / mtbf)
    return times


class LocalOperator:
    """Chaos and hot-adds on the local ``rollcall up`` (its control socket)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    async def training(self) -> list[dict[str, Any]]:
        workers = (await control(self._record, {"op": "list"}))["workers"]
        return [w for w in workers if w["state"] == "training" and w["exit_code"] is None]

    async def signal(self, worker: dict[str, Any], sig: str) -> None:
        await control(self._record, {"op": "kill", "member": str(worker["pid"]), "signal": sig})

    async def add(self) -> str:
        answer = await control(self._record, {"op": "add", "count": 1})
        started = answer["workers"][0]
        return f"{started['name']}: {answer['command']} (log {started['log']})"


class DeploymentOperator:
    """Chaos and hot-adds on a deployment, from this machine: it signals the
    members whose processes run here (found by their listening port) and
    starts new example workers here, detached, logging to ``log_dir``."""

    def __init__(
        self, addresses: Sequence[str], job: str, token_file: Path | None,
        host: str = "127.0.0.1", log_dir: Path | None = None, worker_args: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.addresses, self.job, self.token_file = list(addresses), job, token_file
        self.host, self.worker_args = host, list(worker_args)
        self.log_dir = log_dir or Path(tempfile.gettempdir()) / f"rollcall-workers-{os.getuid()}"

    async def training(self) -> list[dict[str, Any]]:
        from rollcall.membership.config import Config
        from rollcall.protocol.client import RendezvousClient
        from rollcall.protocol.wire import read_token

        client = RendezvousClient(self.addresses, self.job, read_token(self.token_file), Config())
        try:
            view = (await client.status()).view
        finally:
            await client.close()
        found = []
        for member in view.members:
            pid = pid_listening(member.address)
            if pid is not None:
                found.append({"name": member.id, "member_id": member.id, "pid": pid})
        return found

    async def signal(self, worker: dict[str, Any], sig: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(worker["pid"]), SIGNALS[sig])

    async def add(self) -> str:
        private_directory(self.log_dir, "worker log directory")
        log_path = self.log_dir / f"worker-{time.time_ns()}.log"
        argv = [
            sys.executable, "-m", "rollcall.cli", "worker",
            "--rendezvous", ",".join(self.addresses), "--job", self.job,
            "--host", self.host, "--json", "--log-level", "info",
            *(["--token-file", str(self.token_file)] if self.token_file else []),
            *self.worker_args,
        ]  # fmt: skip
        with open_private_append(log_path, binary=True) as log_file:
            proc = subprocess.Popen(
                argv, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        return f"pid {proc.pid}, log {log_path}"


async def run_chaos(
    operator: LocalOperator | DeploymentOperator, mtbf: float, duration: float, seed: int,
    rejoin_after: float | None, sig: str, min_workers: int, say: Any,
) -> dict[str, Any]:  # fmt: skip
    """Kill a random training worker at exponentially distributed intervals
    (mean ``mtbf``) for ``duration`` seconds; with ``rejoin_after``, start a
    replacement that long after each kill (a frozen one is thawed then, and
    exits as evicted). Bounded: it ends ``rejoin_after`` after ``duration``."""
    rng = random.Random(seed)
    started = time.monotonic()
    end = started + duration
    schedule = kill_times(seed, mtbf, duration)
    next_kill = started + schedule.pop(0) if schedule else end
    rejoins: list[tuple[float, dict[str, Any] | None]] = []  # (when, frozen worker to thaw)
    kills = rejoined = 0
    while True:
        now = time.monotonic()
        if now >= end and not rejoins:
            break
        for due in [r for r in rejoins if r[0] <= now]:
            rejoins.remove(due)
            if due[1] is not None:
                with contextlib.suppress(RollcallError):
                    await operator.signal(due[1], "CONT")
            started_what = await operator.add()
            rejoined += 1
            say(f"{now - started:7.2f} s  started {started_what}")
        if now >= next_kill and now < end:
            training = sorted(await operator.training(), key=lambda w: w["name"])
            if len(training) > min_workers:
                victim = rng.choice(training)
                await operator.signal(victim, sig)
                kills += 1
                say(f"{now - started:7.2f} s  SIG{sig} {victim['member_id']} (pid {victim['pid']})")
                if rejoin_after is not None:
                    rejoins.append((now + rejoin_after, victim if sig == "STOP" else None))
            else:
                say(f"{now - started:7.2f} s  skipped: only {len(training)} training workers")
            next_kill = started + schedule.pop(0) if schedule else end
        wake = min([next_kill if next_kill < end else end, *(r[0] for r in rejoins)])
        await asyncio.sleep(max(0.01, min(0.2, wake - time.monotonic())))
    return {"kills": kills, "rejoins": rejoined, "seconds": time.monotonic() - started}
