"""The compose deployment (deploy/docker-compose.yml) on a private Docker
engine, for tests/test_compose.py.

The engine runs in a network namespace this harness creates
(scripts/docker-engine), so container traffic stays in namespaces the test
made; the image is built with scripts/build-image (debootstrap base, local
wheelhouse, no registry). Everything is read from outside the containers:
`rollcall status --json` runs in the engine's namespace against the
rendezvous ports that the compose file publishes on its loopback.

Every wait is bounded; ``close()`` tears everything down and is safe to call
after any failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import wait_for

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
COMPOSE_BIN = ROOT / ".cache" / "deploy" / "bin" / "docker-compose"
#: Where close() leaves every container's log of the last run.
LOG_DIR = ROOT / ".cache" / "deploy" / "compose-test-logs"
IMAGE = "rollcall:latest"
JOB = "compose-test"
PROJECT = "rollcall-test"
NETWORK = f"{PROJECT}_rollcall"
#: Published on the engine namespace's loopback (see deploy/.env).
RENDEZVOUS = "127.0.0.1:7001,127.0.0.1:7002"


class ComposeError(AssertionError):
    """A command or a bounded wait of the harness failed."""


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    service: str
    running: bool
    address: str | None  # on the compose network; None once disconnected


@dataclass(frozen=True)
class Status:
    """One reading of `rollcall status --json`."""

    epoch: int
    members: tuple[tuple[str, str], ...]  # (member id, host:port), in rank order
    leader: str | None
    step: int | None
    raw: dict[str, Any]

    @property
    def hosts(self) -> set[str]:
        return {address.rpartition(":")[0] for _, address in self.members}

    @property
    def member_ids(self) -> set[str]:
        return {member_id for member_id, _ in self.members}


class ComposeCluster:
    """A private engine, the built image and one compose project."""

    def __init__(self) -> None:
        suffix = secrets.token_hex(3)
        self.netns = f"rollcall-test-{suffix}"
        # Short: unix socket paths under it must stay below 108 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="rc-docker-"))
        self.dir = self.base / "engine"
        self.docker_host = f"unix://{self.dir}/docker.sock"
        self.token_file = self.base / "token"
        self.token_file.write_text(secrets.token_hex(24))
        self.token_file.chmod(0o600)
        self.timings: dict[str, float] = {}
        self.engine_started = False

    # --- commands ---------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DOCKER_HOST": self.docker_host,
            "ROLLCALL_IMAGE": IMAGE,
            "ROLLCALL_JOB": JOB,
            "ROLLCALL_TOKEN_FILE": str(self.token_file),
            "ROLLCALL_PUBLISH_ADDRESS": "127.0.0.1",
            "ROLLCALL_RDV1_PORT": "7001",
            "ROLLCALL_RDV2_PORT": "7002",
        }

    def run(
        self, argv: Sequence[str], timeout: float, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run(
                list(argv), cwd=ROOT, env=self._env(), capture_output=True, text=True,
                timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise ComposeError(f"{' '.join(argv)} did not finish within {timeout} s") from exc
        if check and done.returncode != 0:
            raise ComposeError(
                f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}"
                f"\n{done.stderr[-3000:]}"
            )
        return done

    def docker(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        return self.run(["docker", *args], timeout, check).stdout

    def compose(self, *args: str, timeout: float = 120) -> str:
        argv = [str(COMPOSE_BIN), "-f", str(COMPOSE_FILE), "-p", PROJECT, *args]
        return self.run(argv, timeout).stdout

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[what] = time.monotonic() - started

    # --- life cycle -------------------------------------------------------------------

    def start(self, workers: int) -> None:
        """Engine, image, and the compose project with ``workers`` workers,
        all healthy (every worker a member of the view)."""
        with self.timed("engine start"):
            self.engine_started = True
            self.run(
                ["scripts/docker-engine", "start", "--name", self.netns, "--dir", str(self.dir)],
                timeout=600,
            )
        with self.timed("image build (scripts/build-image)"):
            self.run(["scripts/build-image"], timeout=1500)
        with self.timed(f"compose up, {workers} workers healthy"):
            # Leftovers of an earlier run that died in the cached data root.
            self.compose("down", "--remove-orphans", "--timeout", "1")
            self.compose(
                "up", "-d", "--scale", f"worker={workers}", "--wait", "--wait-timeout", "240",
                timeout=300,
            )  # fmt: skip

    def close(self) -> None:
        """Compose down, stop the engine, delete the namespace and the
        directory. Raises if anything is left behind."""
        try:
            if self.engine_started and (self.dir / "docker.sock").exists():
                self.save_logs()
                with self.timed("compose down"):
                    self.run(
                        [str(COMPOSE_BIN), "-f", str(COMPOSE_FILE), "-p", PROJECT,
                         "down", "--remove-orphans", "--timeout", "2"],
                        timeout=120, check=False,
                    )  # fmt: skip
        finally:
            with self.timed("engine stop"):
                self.run(
                    ["scripts/docker-engine", "stop", "--name", self.netns, "--dir", str(self.dir)],
                    timeout=120, check=False,
                )  # fmt: skip
            shutil.rmtree(self.base, ignore_errors=True)
        left = []
        if Path("/run/netns", self.netns).exists():
            left.append(f"network namespace {self.netns}")
        engine = subprocess.run(
            ["pgrep", "-f", str(self.dir)], capture_output=True, text=True, check=False
        )
        left += [f"process {pid}" for pid in engine.stdout.split()]
        with open("/proc/self/mountinfo") as mounts:
            left += [line.split()[4] for line in mounts if str(self.base) in line]
        if left:
            raise ComposeError(f"left behind after teardown: {left}")

    def save_logs(self) -> None:
        """Every container's log and state into LOG_DIR (best effort)."""
        shutil.rmtree(LOG_DIR, ignore_errors=True)
        LOG_DIR.mkdir(parents=True)
        try:
            for container in self.containers():
                state = "running" if container.running else "exited"
                path = LOG_DIR / f"{container.name}.{state}.log"
                path.write_text(self.logs(container))
        except (ComposeError, OSError, ValueError) as exc:
            (LOG_DIR / "error.txt").write_text(str(exc))

    # --- reading the deployment -------------------------------------------------------

    def status(self, timeout: float = 5) -> Status:
        """`rollcall status --json` from outside the containers (in the
        engine's namespace, through the published rendezvous ports)."""
        done = self.run(
            ["ip", "netns", "exec", self.netns, str(ROOT / ".venv" / "bin" / "rollcall"),
             "status", "--rendezvous", RENDEZVOUS, "--job", JOB, "--json",
             "--token-file", str(self.token_file), "--timeout", str(timeout)],
            timeout=timeout + 10,
        )  # fmt: skip
        raw = json.loads(done.stdout)
        return Status(
            epoch=raw["epoch"],
            members=tuple((m["id"], m["address"]) for m in raw["members"]),
            leader=raw.get("leader"),
            step=raw.get("step"),
            raw=raw,
        )

    def try_status(self) -> Status | None:
        try:
            return self.status(timeout=3)
        except (ComposeError, ValueError, KeyError):
            return None

    def containers(self, service: str | None = None) -> list[Container]:
        """The project's containers (running or not), sorted by name."""
        argv = ["ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service is not None:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = self.docker(*argv).split()
        if not ids:
            return []
        found = []
        for item in json.loads(self.docker("inspect", *ids)):
            network = item["NetworkSettings"]["Networks"].get(NETWORK)
            found.append(
                Container(
                    id=item["Id"],
                    name=item["Name"].lstrip("/"),
                    service=item["Config"]["Labels"]["com.docker.compose.service"],
                    running=item["State"]["Running"],
                    address=(network or {}).get("IPAddress") or None,
                )
            )
        return sorted(found, key=lambda c: c.name)

    def running(self, service: str | None = None) -> list[Container]:
        return [c for c in self.containers(service) if c.running]

    def logs(self, container: Container) -> str:
        done = self.run(["docker", "logs", container.id], timeout=30)
        return done.stdout + done.stderr

    def wait_for_view(self, what: str, accept: Callable[[Status], bool], timeout: float) -> Status:
        """The first status reading that ``accept`` takes."""
        seen: list[Status | None] = []

        def probe() -> Status | None:
            status = self.try_status()
            seen[:] = [status]
            return status if status is not None and accept(status) else None

        try:
            status: Status = wait_for(probe, what, timeout, every=0.5)
            return status
        except AssertionError as exc:
            raise ComposeError(f"{exc}; last status: {seen[0].raw if seen[0] else None}") from None

    def wait_for_progress(self, after: int, steps: int, timeout: float) -> Status:
        """A status whose committed step is at least ``after + steps``."""
        return self.wait_for_view(
            f"step {after + steps} (training advancing)",
            lambda s: s.step is not None and s.step >= after + steps,
            timeout,
        )
