"""Real processes for integration tests: rendezvous replicas (the `rollcall`
CLI) and lightweight members (tests/member_process.py). Every process is
killed when its owner is cleaned up, and with the test runner if it dies
(PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rollcall.tether import tethered

ROOT = Path(__file__).resolve().parent.parent


class Process:
    """A child process whose stdout lines are collected in the background."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            tethered(argv),
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        #: Every stdout line with the time (``time.monotonic()``) it was read.
        self.arrivals: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.arrivals.append((time.monotonic(), line))
            self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first line (seen before or arriving) matching ``predicate``."""
        for line in self.seen:
            if predicate(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching line within {timeout} s; log: {self.log_tail()}")
            try:
                line = self.lines.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(timeout=5)  # lines written before the exit
                if self.proc.poll() is not None and self.lines.empty():
                    raise RuntimeError(
                        f"process exited ({self.proc.returncode}); log: {self.log_tail()}"
                    ) from None
                continue
            self.seen.append(line)
            if predicate(line):
                return line

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """The first JSON line (seen before or arriving) matching ``predicate``."""

        def match(line: str) -> bool:
            try:
                return bool(predicate(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                return False

        return dict(json.loads(self.wait_line(match, timeout)))

    def read_all(self, exited: bool = False) -> list[str]:
        """Every stdout line so far (``seen``, with those that arrived since
        moved into it). ``exited``: the process exited; its last lines are
        waited for (up to 5 s: a child it left may hold its stdout open)."""
        if exited:
            assert self.proc.poll() is not None, "the process is still running"
            self._reader.join(timeout=5)
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())
        return self.seen

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (after SIGCONT, in case it is frozen), then SIGKILL."""
        self.terminate()
        return self.reap(timeout)

    def terminate(self) -> None:
        """SIGTERM, after SIGCONT in case it is frozen; ``reap`` waits for it."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def reap(self, timeout: float) -> int:
        """Waits for it to exit, SIGKILLed after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            self._log.close()


def stop_together(processes: Iterable[Process], timeout: float = 20.0) -> None:
    """Stops every one of ``processes``, as ``Process.stop`` does, but sends
    them all SIGTERM first: one after the other, every worker's clean leave
    is a view change that the ones still running go through before their
    own. Cleanup: an error stopping one is no reason to leave the others."""
    processes = list(processes)
    for process in processes:
        with contextlib.suppress(Exception):
            process.terminate()
    for process in processes:
        try:
            process.reap(timeout)
        except Exception:  # noqa: BLE001 - cleanup must reach every process
            with contextlib.suppress(Exception):
                process.proc.kill()


class ReplicaProcess(Process):
    """``rollcall rendezvous`` on a free loopback port."""

    def __init__(
        self,
        etcd: Sequence[str],
        job: str,
        token_file: Path,
        port: int,
        log_path: Path,
        settings: Sequence[str] = (),
        events: Path | None = None,
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            "rollcall.cli",
            "rendezvous",
            "--etcd",
            ",".join(etcd),
            "--listen",
            f"127.0.0.1:{port}",
            "--job",
            job,
            "--token-file",
            str(token_file),
            "--log-level",
            "info",
        ]
        for item in settings:
            argv += ["--set", item]
        if events is not None:
            argv += ["--events", str(events)]
        super().__init__(argv, None, log_path)
        self.address = f"127.0.0.1:{port}"
        self.wait_line(lambda line: line.startswith("rendezvous ready at"), timeout=30)


class MemberProcess(Process):
    """tests/member_process.py: joins, prints its views as JSON lines."""

    def __init__(
        self,
        rendezvous: Sequence[str],
        job: str,
        token: str,
        log_path: Path,
        name: str = "p",
        progress: bool = False,
        agent: str | None = None,
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            "tests.member_process",
            "--rendezvous",
            ",".join(rendezvous),
            "--job",
            job,
            "--name",
            name,
        ]
        if progress:
            argv.append("--progress")
        if agent is not None:
            argv += ["--agent", agent]
        super().__init__(argv, {"ROLLCALL_TOKEN": token}, log_path)
        joined = self.wait_event(lambda e: e["event"] == "joined", timeout=30)
        self.member_id: str = joined["member_id"]
        #: Its member secret: what a request naming it must carry.
        self.secret: str = joined["secret"]

    def views(self) -> list[dict[str, Any]]:
        events = [json.loads(line) for line in self.read_all() if line.startswith("{")]
        return [e for e in events if e["event"] == "view"]


#: Config overrides the replicas run with in integration tests: short leases
#: so failover and expiry tests finish in seconds.
TEST_SETTINGS = ("member_lease_ttl=6", "election_ttl=2", "takeover_grace=2.0")


class ControlPlane:
    """Rendezvous replicas (real processes) for one job on a given etcd."""

    def __init__(
        self,
        etcd: Sequence[str],
        workdir: Path,
        job: str = "job1",
        replicas: int = 1,
        settings: Sequence[str] = TEST_SETTINGS,
        events: bool = False,
    ) -> None:
        from rollcall.etcd_local import free_port

        self.etcd = list(etcd)
        self.workdir = workdir
        self.job = job
        self.token = "test-token-" + os.urandom(8).hex()
        self.token_file = workdir / "token"
        self.token_file.write_text(self.token)
        self.settings = tuple(settings)
        #: Every replica appends its view-change records here (docs/events.md).
        self.events = workdir / "events.jsonl" if events else None
        self.replicas: list[ReplicaProcess] = []
        self.members: list[MemberProcess] = []
        self._free_port = free_port
        try:
            for _ in range(replicas):
                self.add_replica()
        except BaseException:
            self.close()
            raise

    def add_replica(self) -> ReplicaProcess:
        index = len(self.replicas)
        replica = ReplicaProcess(
            self.etcd, self.job, self.token_file, self._free_port(),
            self.workdir / f"replica{index}.log", self.settings, self.events,
        )  # fmt: skip
        self.replicas.append(replica)
        return replica

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def add_member(
        self, name: str = "p", progress: bool = False, agent: str | None = None
    ) -> MemberProcess:
        member = MemberProcess(
            self.addresses, self.job, self.token,
            self.workdir / f"member{len(self.members)}.log", name=name, progress=progress,
            agent=agent,
        )  # fmt: skip
        self.members.append(member)
        return member

    def environment(self) -> dict[str, str]:
        """What a user's own training script needs to find the job."""
        return {
            "ROLLCALL_RENDEZVOUS": ",".join(self.addresses),
            "ROLLCALL_JOB": self.job,
            "ROLLCALL_TOKEN": self.token,
        }

    def client(self) -> Any:
        """An async RendezvousClient for this job (create it inside the event loop)."""
        from rollcall.protocol.client import RendezvousClient

        return RendezvousClient(self.addresses, self.job, self.token)

    def status_json(self, *extra: str) -> dict[str, Any]:
        """`rollcall status --json` run as a command, parsed."""
        result = subprocess.run(
            [sys.executable, "-m", "rollcall.cli", "status", "--rendezvous",
             ",".join(self.addresses), "--job", self.job, "--json",
             "--token-file", str(self.token_file), *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"status failed ({result.returncode}): {result.stderr.strip()}")
        return json.loads(result.stdout)

    def close(self) -> None:
        stop_together(self.members, timeout=5)
        for process in self.replicas:
            try:
                process.stop(timeout=5)
            except Exception:  # noqa: BLE001 - cleanup must reach every process
                process.proc.kill()


class AgentProcess(Process):
    """``rollcall agent`` on a Unix socket in ``workdir``."""

    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        self.address = f"unix:{workdir / 'agent.sock'}"
        argv = [
            sys.executable, "-m", "rollcall.cli", "agent", "--rendezvous",
            ",".join(plane.addresses), "--job", plane.job, "--listen", self.address,
            "--token-file", str(plane.token_file), "--log-level", "info",
        ]  # fmt: skip
        super().__init__(argv, None, workdir / "agent.log")
        self.wait_line(lambda line: line.startswith("agent ready at"), timeout=30)


class WorkerProcess(Process):
    """`rollcall worker --example lm --json`: a real training process."""

    def __init__(
        self,
        plane: ControlPlane,
        log_path: Path,
        steps: int = 1000,
        ledger: Path | None = None,
        extra: Sequence[str] = (),
        wait_joined: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """Starts the worker (``env`` added to its environment) and, with
        ``wait_joined``, waits until it joined (else ``member_id`` is "" and
        the caller watches it exit, say)."""
        argv = [
            sys.executable, "-m", "rollcall.cli", "worker",
            "--rendezvous", ",".join(plane.addresses), "--job", plane.job,
            "--token-file", str(plane.token_file), "--json", "--digest-every", "1",
            "--steps", str(steps), "--log-level", "info", *extra,
        ]  # fmt: skip
        if ledger is not None:
            argv += ["--ledger", str(ledger)]
        super().__init__(argv, env, log_path)
        self.ledger = ledger
        self.member_id = ""
        if wait_joined:
            self.wait_joined()

    def wait_joined(self, timeout: float = 60.0) -> str:
        """Waits until it joined; its ``member_id``, also returned."""
        joined = self.wait_event(lambda e: e["event"] == "joined", timeout=timeout)
        self.member_id = joined["member_id"]
        return self.member_id

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read_all() if line.startswith("{")]

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "step"]


class ProgramProcess(Process):
    """A user's own training script (tests/programs/) finding the job through
    the environment, printing JSON lines."""

    def __init__(
        self, plane: ControlPlane, program: str, args: Sequence[str], log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        argv = [sys.executable, str(ROOT / "tests" / "programs" / program), *args]
        super().__init__(argv, {**plane.environment(), **(env or {})}, log_path)

    def last_step(self) -> int:
        """The newest step it printed (-1 before any)."""
        return max((e["step"] for e in self.events("step")), default=-1)

    def world(self) -> int:
        """The world size of the newest step it printed (0 before any)."""
        steps = self.events("step")
        return int(steps[-1]["world"]) if steps else 0

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = [json.loads(line) for line in self.read_all() if line.startswith("{")]
        return [e for e in found if kind is None or e["event"] == kind]


def wait_for(
    check: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:  # fmt: skip
    """Poll ``check`` every ``every`` seconds until it returns something true
    (returned); fail the test naming ``what`` after ``timeout`` seconds, with
    what ``explain()`` returns then (the logs that say why, for a failure
    seen only in CI)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    detail = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")


def log_tails(processes: Iterable[Process], lines: int = 30) -> str:
    """The last ``lines`` of each process's log, headed by its file name."""
    return "\n".join(f"--- {p.log_path.name}\n{p.log_tail(lines)}" for p in processes)


def start_together(
    into: list[WorkerProcess], start: Callable[[int], WorkerProcess], count: int
) -> list[WorkerProcess]:
    """Starts ``count`` workers at once (``start(i)``, not waiting for them
    to join), appending each to ``into`` as it starts so that the caller's
    cleanup reaches it, then waits until every one joined. One after the
    other, each one's start-up (``import torch``, seconds) is sat out in
    turn, with the ones already in training beside it on the same cores."""
    started = []
    for _ in range(count):
        worker = start(len(into))
        into.append(worker)
        started.append(worker)
    for worker in started:
        worker.wait_joined()
    return started


@contextlib.contextmanager
def training_team(
    etcd_endpoints: Sequence[str], tmp_path: Path, settings: Sequence[str], count: int = 3,
    patience: float = 60.0,
) -> Iterator[tuple[ControlPlane, list[WorkerProcess]]]:
    """A replica and ``count`` workers of the built-in example, each past
    its first step at full size; every one of them stopped at the end."""
    plane = ControlPlane(list(etcd_endpoints), tmp_path, settings=tuple(settings))
    workers: list[WorkerProcess] = []
    try:
        start_together(
            workers,
            lambda index: WorkerProcess(
                plane, tmp_path / f"worker{index}.log", steps=1_000_000, wait_joined=False
            ),
            count,
        )
        for worker in workers:
            worker.wait_event(
                lambda e: e["event"] == "step" and e["world"] == count, timeout=patience
            )
        yield plane, workers
    finally:
        stop_together(workers, timeout=20)
        plane.close()


def last_step(worker: WorkerProcess) -> int:
    """The highest step ``worker`` reported committing."""
    return max(e["step"] for e in worker.steps())
