"""Several hosts on one machine: each in its own network namespace, all on
one private Ethernet segment, with faults injected in the network itself.

A :class:`Network` is a *hub* namespace holding a Linux bridge, and one
namespace per :class:`Host` whose ``eth0`` is a veth plugged into that bridge.
Nothing is created in the caller's own namespace: the bridge, the veths and
the addresses (``10.213.0.0/24``) exist only inside namespaces the harness
made, so parallel networks (and the machine's real interfaces) never clash,
and deleting the namespaces removes every trace.

Faults are rules of an nftables ``bridge`` table in the hub, so they act like
a switch dropping frames: a partitioned or isolated host gets no TCP reset
and no local error, its packets simply vanish (a lost machine, as seen by its
peers). ``partition(a, b)`` drops IPv4 between two groups (or one way only),
``isolate(host)`` cuts one host off from every other, ``heal()`` lifts all of
it at once. ``freeze``/``thaw``/``kill`` act on processes.

Processes run in a host through ``ip netns exec`` under ``rollcall.tether``
(:class:`tests.harness.Process`), so they die with the test runner. The
namespaces of a network are named ``rcf-<pid>-<id>-<host>``; a network left
behind by a runner that died is removed by :func:`remove_stale` (called when
a network is created). Needs root, ``ip`` (iproute2) and ``nft`` (nftables):
``scripts/setup-netns`` installs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rollcall.etcd_local import await_stopped, etcd_flags, pid_alive
from tests.harness import TEST_SETTINGS, Process

#: Every namespace this harness makes starts with this.
PREFIX = "rcf-"
#: The hosts' /24, private to each network (it exists only in its namespaces).
SUBNET = "10.213.0"
#: The hub's nftables table holding the fault rules.
_TABLE = "bridge rollcall_faults"
#: Host names become part of namespace names; keep them short and plain.
_HOST_NAME = re.compile(r"^[a-z0-9]{1,12}$")
_NS_NAME = re.compile(r"^rcf-(\d+)-[0-9a-f]+-")
#: freeze()/thaw() wait at most this long for the kernel to apply the signal.
_SIGNAL_SETTLE = 2.0
_COMMAND_TIMEOUT = 30.0
#: The cgroup v1 cpu controller: a throttled host's processes go into a
#: child group named like the host's namespace, with a CFS quota.
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


class NetworkError(RuntimeError):
    """A namespace, link or rule could not be set up or removed."""


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        raise NetworkError(f"{' '.join(argv)} did not finish in {_COMMAND_TIMEOUT} s") from exc
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def require_tools() -> None:
    """Raise :class:`NetworkError` naming what is missing to build networks."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(f"missing {', '.join(missing)}: run scripts/setup-netns")
    if os.geteuid() != 0:
        raise NetworkError("network namespaces need root")


def namespaces() -> list[str]:
    """Every network namespace name on the machine (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _namespace_pids(netns: str) -> list[int]:
    try:
        return [int(p) for p in _run(["ip", "netns", "pids", netns]).split()]
    except NetworkError:
        return []


def _kill_and_delete(netns: str) -> None:
    """SIGKILL what runs in ``netns`` (all started by this harness), then
    delete it; a namespace still held by a process would outlive the name."""
    for _ in range(50):
        pids = _namespace_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if netns in namespaces():
        _run(["ip", "netns", "delete", netns])


#: Prefixes of the networks this process has created and not destroyed.
_live_prefixes: set[str] = set()


def _is_stale(name: str) -> bool:
    match = _NS_NAME.match(name)
    if match is None:
        return False
    pid = int(match.group(1))
    if pid == os.getpid():  # ours, or a dead runner's whose pid was reused
        return not any(name.startswith(prefix) for prefix in _live_prefixes)
    return not pid_alive(pid)


def remove_stale() -> list[str]:
    """Delete this harness's namespaces and CPU cgroups whose creating
    process is gone (a runner killed before its cleanup); returns their names."""
    stale = []
    for name in namespaces():
        if _is_stale(name):
            _kill_and_delete(name)
            stale.append(name)
    for group in _cpu_groups(PREFIX):
        if _is_stale(group.name):
            _remove_cpu_group(group)
            stale.append(str(group))
    return stale


def _cpu_groups(prefix: str) -> list[Path]:
    if not CPU_CGROUPS.is_dir():
        return []
    return [group for group in CPU_CGROUPS.iterdir() if group.name.startswith(prefix)]


def _remove_cpu_group(group: Path) -> None:
    """Move the group's processes back to the root group and remove it."""
    for _ in range(50):
        try:
            pids = (group / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):  # ended meanwhile
                (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        time.sleep(0.02)
    try:
        group.rmdir()
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):  # already gone is what we want
            raise NetworkError(f"cannot remove cgroup {group}: {exc}") from exc


class Host:
    """One machine: a network namespace with ``eth0`` at ``address``."""

    def __init__(self, network: Network, name: str, address: str) -> None:
        self.network = network
        self.name = name
        self.netns = f"{network.prefix}{name}"
        self.address = address

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def spawn(
        self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> Process:
        """A tethered process in this host (stdout collected, stderr to ``log_path``)."""
        return Process(self.argv(argv), env, log_path)

    def run(self, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a short command in this host and return its result (never raises
        on a non-zero exit; raises ``subprocess.TimeoutExpired``)."""
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        return _namespace_pids(self.netns)

    def throttle(self, share: float, period: float = 0.1) -> None:
        """Limit this host's processes (those running now) to ``share`` of
        one CPU, granted as ``share * period`` of CPU time per ``period``
        seconds (a CFS quota: within a period the processes run until the
        quota is used, then wait for the next period). Throttling again
        replaces the limit."""
        if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
            raise NetworkError(f"throttling needs the cgroup v1 cpu controller at {CPU_CGROUPS}")
        period_us = round(period * 1_000_000)
        quota_us = round(share * period_us)
        if not 1_000 <= period_us <= 1_000_000 or quota_us < 1_000:
            raise ValueError(
                f"period {period} s must be 1 ms..1 s and share x period at least 1 ms"
            )
        group = self.cpu_group
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        for pid in self.pids():
            with contextlib.suppress(OSError):  # ended meanwhile
                (group / "cgroup.procs").write_text(str(pid))

    def unthrottle(self) -> None:
        """Lift :meth:`throttle` (nothing if not throttled)."""
        _remove_cpu_group(self.cpu_group)

    @property
    def cpu_group(self) -> Path:
        return CPU_CGROUPS / self.netns

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"


class Network:
    """A bridge in a hub namespace and hosts plugged into it.

    Use as a context manager: everything is removed on exit, processes in
    the hosts included, whatever happened in between.
    """

    def __init__(self) -> None:
        require_tools()
        self.id = secrets.token_hex(3)
        self.prefix = f"{PREFIX}{os.getpid()}-{self.id}-"
        self.hub = f"{self.prefix}hub"
        self.hosts: dict[str, Host] = {}
        #: (source address, destination address) pairs whose packets are dropped.
        self._blocked: set[tuple[str, str]] = set()
        self._created: list[str] = []

    # --- life cycle ---------------------------------------------------------------
    def create(self) -> Network:
        remove_stale()
        _live_prefixes.add(self.prefix)
        self._add_namespace(self.hub)
        hub = ["ip", "-n", self.hub]
        _run([*hub, "link", "set", "lo", "up"])
        _run([*hub, "link", "add", "br0", "type", "bridge"])
        _run([*hub, "link", "set", "br0", "up"])
        _run(
            ["ip", "netns", "exec", self.hub, "nft", "-f", "-"],
            stdin=(
                f"table {_TABLE} {{\n"
                "  set blocked { type ipv4_addr . ipv4_addr; }\n"
                "  chain forward {\n"
                "    type filter hook forward priority 0;\n"
                "    ip saddr . ip daddr @blocked drop\n"
                "  }\n"
                "}\n"
            ),
        )
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def add_host(self, name: str) -> Host:
        """A new host on the bridge, at the next free address (.2, .3, ...)."""
        if not _HOST_NAME.match(name) or name == "hub" or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        index = len(self.hosts) + 2
        if index > 254:
            raise ValueError("a network holds at most 253 hosts")
        host = Host(self, name, f"{SUBNET}.{index}")
        self._add_namespace(host.netns)
        port = f"p{index}"  # interface names are per namespace: no clash
        _run(["ip", "-n", self.hub, "link", "add", port, "type", "veth",
              "peer", "name", "eth0", "netns", host.netns])  # fmt: skip
        _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        self.hosts[name] = host
        return host

    def destroy(self) -> None:
        """Kill every process in the hosts and delete all namespaces (the
        bridge and veths go with them). Idempotent."""
        errors = []
        for name in reversed(self._created):
            try:
                _kill_and_delete(name)
            except NetworkError as exc:
                errors.append(str(exc))
        for group in _cpu_groups(self.prefix):
            try:
                _remove_cpu_group(group)
            except NetworkError as exc:
                errors.append(str(exc))
        self._created = []
        _live_prefixes.discard(self.prefix)
        if errors:
            raise NetworkError("; ".join(errors))

    def leftovers(self) -> list[str]:
        """This network's namespaces and CPU cgroups that still exist."""
        left = [name for name in namespaces() if name.startswith(self.prefix)]
        return left + [str(group) for group in _cpu_groups(self.prefix)]

    def __enter__(self) -> Network:
        try:
            return self.create()
        except BaseException:
            self.destroy()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    # --- faults -------------------------------------------------------------------
    def partition(
        self, group_a: Iterable[Host], group_b: Iterable[Host], one_way: bool = False
    ) -> None:
        """Drop every packet from ``group_a`` to ``group_b`` and, unless
        ``one_way``, back. Adds to the faults already in place."""
        a, b = list(group_a), list(group_b)
        if {h.name for h in a} & {h.name for h in b}:
            raise ValueError("a host cannot be on both sides of a partition")
        pairs = {(x.address, y.address) for x in a for y in b}
        if not one_way:
            pairs |= {(y, x) for x, y in pairs}
        self._apply(self._blocked | pairs)

    def isolate(self, host: Host) -> None:
        """Cut ``host`` off from every other host, both ways (a lost machine)."""
        self.partition([host], [h for h in self.hosts.values() if h is not host])

    def heal(self) -> None:
        """Lift every partition and isolation."""
        self._apply(set())

    def _apply(self, pairs: set[tuple[str, str]]) -> None:
        # One nft transaction: the whole new rule set takes effect at once.
        script = f"flush set {_TABLE} blocked\n"
        if pairs:
            elements = ", ".join(f"{src} . {dst}" for src, dst in sorted(pairs))
            script += f"add element {_TABLE} blocked {{ {elements} }}\n"
        _run(["ip", "netns", "exec", self.hub, "nft", "-f", "-"], stdin=script)
        self._blocked = pairs


# --- processes -------------------------------------------------------------------------


def _signal_and_await(process: Process, sig: signal.Signals, stopped: bool) -> None:
    if process.proc.poll() is not None:
        return
    process.signal(sig)
    if not await_stopped(process.pid, stopped, _SIGNAL_SETTLE):
        raise NetworkError(f"pid {process.pid} did not {'stop' if stopped else 'continue'}")


def freeze(process: Process) -> None:
    """SIGSTOP; returns once the kernel reports the process stopped."""
    _signal_and_await(process, signal.SIGSTOP, stopped=True)


def thaw(process: Process) -> None:
    """SIGCONT after :func:`freeze`; returns once the process runs again."""
    _signal_and_await(process, signal.SIGCONT, stopped=False)


def kill(process: Process) -> None:
    """SIGKILL and reap (a crash: the kernel resets its connections)."""
    process.kill()


# --- a rollcall deployment on a network -------------------------------------------------

#: Replica settings in fault tests: short leases so expiry and takeover happen
#: within seconds.
CLUSTER_SETTINGS = TEST_SETTINGS
#: CPU throttles (share of one CPU, CFS period in s) of a slow worker. Below
#: the detector's threshold it gets 25 ms of CPU every 100 ms: slow, but its
#: heartbeats still go out every ~100 ms. Above it, 1 ms every second: the
#: heartbeat thread runs at most once a second; measured, its heartbeats are
#: then more than phi's ~1.5 s apart (evicted in ~1.8 s).
SLOW_BELOW = (0.25, 0.1)
SLOW_ABOVE = (0.001, 1.0)
_ETCD_CLIENT_PORT = 2379
_ETCD_PEER_PORT = 2380
_REPLICA_PORT = 7000
_START_TIMEOUT = 60.0
#: Run in a host: wait until an etcd member reports itself healthy (it has a leader).
_ETCD_HEALTH_PROBE = """
import contextlib, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    with contextlib.suppress(OSError):  # not listening yet: ask again
        with urllib.request.urlopen(url, timeout=0.5) as answer:
            if b'"true"' in answer.read():
                sys.exit(0)
    time.sleep(0.05)
sys.exit(1)
"""


class EtcdMember:
    """One etcd server on its own host; ``kill()``/``start()`` crash it and
    bring it back with its data."""

    def __init__(self, host: Host, data_dir: Path, initial_cluster: str, single: bool) -> None:
        self.host = host
        self.data_dir = data_dir
        self.initial_cluster = initial_cluster
        self.single = single
        self.process: Process | None = None
        self.starts = 0

    @property
    def client_url(self) -> str:
        return f"http://{self.host.address}:{_ETCD_CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.address}:{_ETCD_PEER_PORT}"

    def launch(self, token: str) -> None:
        """Start the server without waiting for it (members of a new cluster
        can only answer once a quorum is up)."""
        binary = shutil.which("etcd")
        if binary is None:
            raise NetworkError("etcd binary not found: run scripts/setup")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.starts += 1
        argv = [binary, *etcd_flags(
            self.host.name, self.data_dir, self.client_url, self.peer_url,
            self.initial_cluster, token, alone=self.single,
        )]  # fmt: skip
        log = self.data_dir.parent / f"{self.host.name}-{self.starts}.log"
        self.process = self.host.spawn(argv, log)

    def kill(self) -> None:
        if self.process is not None:
            kill(self.process)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.proc.poll() is None


class Replica(Process):
    """``rollcall rendezvous`` on its own host, port 7000."""

    def __init__(
        self, host: Host, etcd: Sequence[str], job: str, token_file: Path, log_path: Path,
        settings: Sequence[str],
    ) -> None:  # fmt: skip
        self.host = host
        self.address = f"{host.address}:{_REPLICA_PORT}"
        argv = [
            sys.executable, "-m", "rollcall.cli", "rendezvous", "--etcd", ",".join(etcd),
            "--listen", self.address, "--job", job, "--token-file", str(token_file),
            "--log-level", "info",
        ]  # fmt: skip
        for item in settings:
            argv += ["--set", item]
        super().__init__(host.argv(argv), None, log_path)

    def wait_ready(self, timeout: float = _START_TIMEOUT) -> None:
        self.wait_line(lambda line: line.startswith("rendezvous ready at"), timeout)


class Worker(Process):
    """``rollcall worker --json --digest-every 1`` on its own host."""

    def __init__(
        self, host: Host, rendezvous: Sequence[str], job: str, token_file: Path,
        log_path: Path, ledger: Path, steps: int, env: dict[str, str] | None = None,
        settings: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """``settings``: config overrides (``--set NAME=VALUE``)."""
        self.host = host
        self.ledger = ledger
        self.member_id = ""
        argv = [
            sys.executable, "-m", "rollcall.cli", "worker", "--rendezvous", ",".join(rendezvous),
            "--job", job, "--token-file", str(token_file), "--host", host.address,
            "--name", host.name, "--json", "--digest-every", "1", "--steps", str(steps),
            "--ledger", str(ledger), "--log-level", "info",
            *(arg for item in settings for arg in ("--set", item)),
        ]  # fmt: skip
        super().__init__(host.argv(argv), env, log_path)

    def wait_joined(self, timeout: float = _START_TIMEOUT) -> None:
        self.member_id = self.wait_event(lambda e: e["event"] == "joined", timeout)["member_id"]

    def wait_step(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """The first committed step (seen before or arriving) matching ``predicate``."""
        return self.wait_event(lambda e: e["event"] == "step" and predicate(e), timeout)

    def timed_events(self) -> list[tuple[float, dict[str, Any]]]:
        """Every JSON event so far, with the time it was read."""
        found = []
        for at, line in list(self.arrivals):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                found.append((at, event))
        return found

    def events(self) -> list[dict[str, Any]]:
        return [event for _, event in self.timed_events()]

    def timed_steps(self) -> list[tuple[float, dict[str, Any]]]:
        return [(at, e) for at, e in self.timed_events() if e.get("event") == "step"]

    def steps(self) -> list[dict[str, Any]]:
        return [e for _, e in self.timed_steps()]

    def __repr__(self) -> str:
        return f"Worker({self.host.name}, {self.member_id or '?'}, pid {self.pid})"


@dataclass(frozen=True)
class StatusSample:
    """One answer of `rollcall status --json` (or its failure)."""

    at: float
    epoch: int | None = None
    members: tuple[str, ...] = ()
    step: int | None = None
    leader: str | None = None
    error: str | None = None


class StatusSampler:
    """Asks `rollcall status --json` from an observer host every ``interval``
    seconds in a background thread, keeping every answer."""

    def __init__(self, cluster: Cluster, interval: float = 1.0) -> None:
        self.cluster = cluster
        self.interval = interval
        self.samples: list[StatusSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="status-sampler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.cluster.sample_status())
            self._stop.wait(self.interval)


class Cluster:
    """etcd members, rendezvous replicas, an observer and workers, each on a
    host of its own on one :class:`Network`. A context manager: everything
    is stopped and removed on exit."""

    def __init__(
        self,
        workdir: Path,
        etcd_members: int = 1,
        replicas: int = 1,
        job: str = "faults",
        settings: Sequence[str] = CLUSTER_SETTINGS,
        worker_steps: int = 100_000,
    ) -> None:
        self.workdir = workdir
        self.job = job
        self.settings = tuple(settings)
        self.worker_steps = worker_steps
        workdir.mkdir(parents=True, exist_ok=True)
        self.token_file = workdir / "token"
        self.token_file.write_text("fault-token-" + secrets.token_hex(8))
        self.network = Network()
        self.etcd: list[EtcdMember] = []
        self.replicas: list[Replica] = []
        self.workers: list[Worker] = []
        #: Replicas replaced by ``restart_replica`` (checked for leftovers).
        self.retired: list[Replica] = []
        self.sampler = StatusSampler(self)
        self._etcd_token = f"rollcall-faults-{secrets.token_hex(4)}"
        self._sizes = (etcd_members, replicas)
        #: Measured stalls by name (seconds), for the report of a test.
        self.stalls: dict[str, float] = {}
        #: Worker -> the last epoch it may have committed in (it left after it).
        self.left_after: dict[Worker, int] = {}
        #: (time.monotonic(), what) of every fault injected, for the report.
        self.timeline: list[tuple[float, str]] = []
        #: [start, end] of each time the control plane was down on purpose
        #: (etcd without quorum): no view can change, so a stall there is
        #: excused until ``stall_bound`` after its end (end inf: still down).
        self.outages: list[list[float]] = []
        #: The longest time without any committed step outside an outage.
        self.stall_bound = stall_bound(self.settings)

    # --- life cycle ---------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.network.create()
            self.observer = self.network.add_host("obs")
            self._start_etcd(self._sizes[0])
            for index in range(self._sizes[1]):
                self.add_replica(index)
            for replica in self.replicas:
                replica.wait_ready()
            self.sampler.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start_etcd(self, size: int) -> None:
        hosts = [self.network.add_host(f"etcd{i}") for i in range(size)]
        initial = ",".join(f"{h.name}=http://{h.address}:{_ETCD_PEER_PORT}" for h in hosts)
        self.etcd = [
            EtcdMember(h, self.workdir / "etcd" / h.name, initial, single=size == 1) for h in hosts
        ]
        for member in self.etcd:
            member.launch(self._etcd_token)
        for member in self.etcd:
            self.wait_etcd_healthy(member)

    def wait_etcd_healthy(self, member: EtcdMember, timeout: float = _START_TIMEOUT) -> None:
        done = self.observer.run(
            [sys.executable, "-c", _ETCD_HEALTH_PROBE, f"{member.client_url}/health",
             str(timeout)],
            timeout=timeout + 10,
        )  # fmt: skip
        if done.returncode != 0:
            log = member.process.log_tail(30) if member.process else "(not started)"
            raise NetworkError(f"etcd {member.host.name} not healthy in {timeout} s:\n{log}")

    def etcd_leader(self) -> EtcdMember:
        """The etcd member that is the raft leader now (asked with etcdctl
        from the observer host)."""
        done = self.observer.run(
            ["etcdctl", f"--endpoints={','.join(self.etcd_urls)}", "--command-timeout=5s",
             "endpoint", "status", "-w", "json"],
            timeout=20,
        )  # fmt: skip
        try:
            answers = json.loads(done.stdout)
            by_id = {a["Status"]["header"]["member_id"]: a["Endpoint"] for a in answers}
            leader_url = by_id[answers[0]["Status"]["leader"]]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise NetworkError(f"no etcd leader in {done.stdout!r} {done.stderr!r}") from exc
        return next(m for m in self.etcd if m.client_url == leader_url)

    def restart_etcd(self, member: EtcdMember) -> None:
        """Start a killed member again with its data (returns without
        waiting: with quorum lost, one member alone never becomes healthy)."""
        member.launch(self._etcd_token)

    @property
    def etcd_urls(self) -> list[str]:
        return [m.client_url for m in self.etcd]

    def add_replica(self, index: int) -> Replica:
        host = self.network.add_host(f"rdv{index}")
        replica = Replica(
            host, self.etcd_urls, self.job, self.token_file,
            self.workdir / f"{host.name}.log", self.settings,
        )  # fmt: skip
        self.replicas.append(replica)
        return replica

    def restart_replica(self, replica: Replica) -> Replica:
        """Start a killed replica again on its host, in its place in the list."""
        index = self.replicas.index(replica)
        self.retired.append(replica)
        again = Replica(
            replica.host, self.etcd_urls, self.job, self.token_file,
            self.workdir / f"{replica.host.name}-{len(self.retired)}.log", self.settings,
        )  # fmt: skip
        self.replicas[index] = again
        return again

    def rendezvous_leader(self, timeout: float = _START_TIMEOUT) -> Replica:
        """The replica that leads now, by `rollcall status` (which names it)."""
        deadline = time.monotonic() + timeout
        while True:
            sample = self.sample_status()
            for replica in self.replicas:
                if sample.leader == replica.address and replica.proc.poll() is None:
                    return replica
            if time.monotonic() > deadline:
                raise NetworkError(f"no live leading replica within {timeout} s: {sample}")
            time.sleep(0.2)

    @property
    def rendezvous(self) -> list[str]:
        return [r.address for r in self.replicas]

    def start_workers(
        self, count: int, timeout: float = _START_TIMEOUT, env: dict[str, str] | None = None,
        settings: Sequence[str] = (),
    ) -> list[Worker]:  # fmt: skip
        """``count`` new workers, each on a new host, started together (with
        ``env`` added to their environment, ``settings`` to their config);
        returns once each has joined."""
        started = []
        for _ in range(count):
            host = self.network.add_host(f"w{len(self.workers)}")
            worker = Worker(
                host, self.rendezvous, self.job, self.token_file,
                self.workdir / f"{host.name}.log", self.workdir / f"{host.name}.ledger.jsonl",
                self.worker_steps, env, settings,
            )  # fmt: skip
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_joined(timeout)
        return started

    def sample_status(self) -> StatusSample:
        """`rollcall status --json`, asked from the observer host."""
        at = time.monotonic()
        try:
            done = self.observer.run(
                [sys.executable, "-m", "rollcall.cli", "status", "--rendezvous",
                 ",".join(self.rendezvous), "--job", self.job, "--json",
                 "--token-file", str(self.token_file), "--timeout", "3"],
                timeout=20,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return StatusSample(at, error="status timed out")
        if done.returncode != 0:
            return StatusSample(at, error=done.stderr.strip()[-300:] or f"exit {done.returncode}")
        try:
            answer = json.loads(done.stdout)
            return StatusSample(
                at, epoch=int(answer["epoch"]),
                members=tuple(m["id"] for m in answer["members"]), step=answer.get("step"),
                leader=answer.get("leader"),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            return StatusSample(at, error=f"unreadable status: {exc}: {done.stdout[:200]}")

    def mark_left(self, worker: Worker, last_epoch: int) -> None:
        """Record that ``worker`` left the views after ``last_epoch`` (evicted,
        cut off, killed): see ``check_invariants``."""
        self.left_after[worker] = last_epoch

    def note(self, what: str) -> float:
        """Record a fault (or other event of the test) now; returns the time."""
        at = time.monotonic()
        self.timeline.append((at, what))
        return at

    def outage_begins(self, what: str) -> float:
        """Note the start of a deliberate control-plane outage (see ``outages``)."""
        at = self.note(what)
        self.outages.append([at, float("inf")])
        return at

    def outage_ends(self, what: str) -> float:
        """Note the end of the outage in progress."""
        at = self.note(what)
        self.outages[-1][1] = at
        return at

    def stop_workers(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                kill(worker)

    def close(self) -> None:
        """Stop everything and delete the network. Idempotent."""
        self.sampler.stop()
        for process in [*self.workers, *self.replicas, *self.retired]:
            try:
                if process.proc.poll() is None:
                    kill(process)
            except Exception:  # noqa: BLE001 - cleanup must reach every process
                process.proc.kill()
        for member in self.etcd:
            member.kill()
        self.network.destroy()

    def leftovers(self) -> list[str]:
        """What is still there after ``close()``: running processes and namespaces."""
        left = list(self.network.leftovers())
        processes: list[Process] = [*self.workers, *self.replicas, *self.retired]
        processes += [m.process for m in self.etcd if m.process is not None]
        left += [f"process {p.pid}" for p in processes if p.proc.poll() is None]
        return left


def example_plan() -> Any:
    """The data plan of the example job as ``rollcall worker`` runs it by
    default (global batch 32, micro batch 8, seed 0): what the ledgers are
    checked against."""
    from rollcall.worker.examples.lm import CharCorpus, LMConfig
    from rollcall.worker.plan import DataPlan

    return DataPlan(num_samples=len(CharCorpus(LMConfig())), global_batch=32, micro_batch=8,
                    seed=0)  # fmt: skip


# --- invariants ---------------------------------------------------------------------------


#: Scheduling on 2 loaded cores, added to every computed bound.
BOUND_SLACK = 10.0


def stall_bound(settings: Sequence[str]) -> float:
    """The longest time a job with replica ``settings`` (``NAME=VALUE``) may
    go without a committed step while its control plane is up: a rendezvous
    leader failover (the old leader's election lease runs out, the new one
    waits out its grace) followed by the eviction of a member lost meanwhile
    (detection, join settle, roll call), plus :data:`BOUND_SLACK`."""
    from rollcall.cli.options import parse_overrides

    config = parse_overrides(tuple(settings))
    failover = config.election_ttl + config.takeover_grace
    return failover + config.eviction_bound() + BOUND_SLACK


def commit_gaps(cluster: Cluster) -> list[tuple[float, float]]:
    """(start, end) of every interval between two consecutive committed
    steps of the job (any worker's, by the time the harness read them)."""
    times = sorted({at for worker in cluster.workers for at, _ in worker.timed_steps()})
    return list(zip(times, times[1:], strict=False))


#: A worker's stdout line is read at most this long after it was written
#: (a loaded 2-core machine): the slack of the "committed after leaving" check.
READ_LAG = 1.0


def check_invariants(cluster: Cluster, plan: Any) -> list[str]:
    """Every violation of the run's invariants, as sentences (empty: none).

    - one committed view per epoch: all step events and ledger records of an
      epoch name one world size, each rank of it is held by one worker, and
      every `rollcall status` answer for an epoch lists the same members (who
      all committed in it only if listed);
    - no worker commits a step after it left the view: a worker marked with
      ``Cluster.mark_left(worker, last_epoch)`` committed nothing in a later
      epoch, and nothing that reached the harness more than ``READ_LAG``
      after another worker committed in a newer view (a commit cannot be
      undone: an evicted worker that applied a step before its eviction is
      let off, its state is discarded; one that applied it after is not);
    - among the workers that stayed, every step was committed in one epoch;
    - digests agree at every step of an epoch;
    - every stall is bounded: no two consecutive committed steps of the job
      are further apart than ``cluster.stall_bound``, except across a
      deliberate control-plane outage (``Cluster.outage_begins``), where the
      bound counts from its end;
    - the merged ledgers agree where they overlap, cover a contiguous range
      of steps from 0, and hold exactly the samples of an uninterrupted run
      (``plan``: a ``rollcall.worker.plan.DataPlan``).
    """
    from rollcall.worker.ledger import Ledger, merge_ledgers

    violations: list[str] = []
    worlds: dict[int, set[int]] = {}
    holders: dict[tuple[int, int], set[str]] = {}
    epochs_of_step: dict[int, set[int]] = {}
    digests: dict[tuple[int, int], set[str]] = {}
    ledgers = []
    for worker in cluster.workers:
        name, stayed = worker.host.name, worker not in cluster.left_after
        for event in worker.steps():
            epoch, step = event["epoch"], event["step"]
            worlds.setdefault(epoch, set()).add(event["world"])
            holders.setdefault((epoch, event["rank"]), set()).add(name)
            if stayed:
                epochs_of_step.setdefault(step, set()).add(epoch)
            if "digest" in event:
                digests.setdefault((epoch, step), set()).add(event["digest"])
            if not 0 <= event["rank"] < event["world"]:
                violations.append(f"{name}: rank {event['rank']} outside world {event['world']}")
        if not worker.ledger.exists():
            continue
        try:
            entries = Ledger.load(worker.ledger).entries()
        except ValueError as exc:
            violations.append(f"{name}: unreadable ledger: {exc}")
            continue
        for step, entry in entries.items():
            worlds.setdefault(entry.view_epoch, set()).add(entry.world_size)
            if stayed:
                epochs_of_step.setdefault(step, set()).add(entry.view_epoch)
        ledgers.append({step: entry.samples for step, entry in entries.items()})

    for epoch, sizes in sorted(worlds.items()):
        if len(sizes) > 1:
            violations.append(f"epoch {epoch}: committed with world sizes {sorted(sizes)}")
    for (epoch, rank), names in sorted(holders.items()):
        if len(names) > 1:
            violations.append(f"epoch {epoch}: rank {rank} held by {sorted(names)}")
    for step, epochs in sorted(epochs_of_step.items()):
        if len(epochs) > 1:
            violations.append(f"step {step}: committed in several epochs {sorted(epochs)}")
    for (epoch, step), found in sorted(digests.items()):
        if len(found) > 1:
            violations.append(f"epoch {epoch} step {step}: digests disagree ({len(found)})")
    violations += _check_status(cluster, worlds)
    violations += _check_left(cluster)
    violations += _check_stalls(cluster)

    try:
        merged = merge_ledgers(ledgers)
    except ValueError as exc:
        violations.append(f"ledgers disagree: {exc}")
        return violations
    if not merged:
        violations.append("no committed step in any ledger")
        return violations
    steps = sorted(merged)
    if steps != list(range(steps[-1] + 1)):
        missing = sorted(set(range(steps[-1] + 1)) - set(steps))
        violations.append(f"ledgers miss steps {missing[:10]} (of 0..{steps[-1]})")
    uninterrupted = {s: plan.step_samples(s) for s in steps}
    violations += [f"ledger: {d}" for d in Ledger.compare(uninterrupted, merged)]
    return violations


def _check_status(cluster: Cluster, worlds: dict[int, set[int]]) -> list[str]:
    violations = []
    views: dict[int, set[tuple[str, ...]]] = {}
    for sample in cluster.sampler.samples:
        if sample.epoch is not None:
            views.setdefault(sample.epoch, set()).add(sample.members)
    for epoch, lists in sorted(views.items()):
        if len(lists) > 1:
            violations.append(f"epoch {epoch}: status showed several member lists {sorted(lists)}")
        sizes = worlds.get(epoch, set())
        for members in lists:
            if sizes and sizes != {len(members)}:
                violations.append(
                    f"epoch {epoch}: status lists {len(members)} members, steps say {sorted(sizes)}"
                )
    for worker in cluster.workers:
        for event in worker.steps():
            lists = views.get(event["epoch"], set())
            if lists and all(worker.member_id not in members for members in lists):
                violations.append(
                    f"{worker.host.name}: committed step {event['step']} in epoch "
                    f"{event['epoch']} without being a member of it"
                )
    return violations


def _check_stalls(cluster: Cluster) -> list[str]:
    violations = []
    origin = cluster.timeline[0][0] if cluster.timeline else 0.0
    for start, end in commit_gaps(cluster):
        excused_until = max(
            (o_end for o_start, o_end in cluster.outages if o_start < end and o_end > start),
            default=start,
        )
        if end > max(start, excused_until) + cluster.stall_bound:
            violations.append(
                f"no step committed for {end - start:.1f} s (from {start - origin:+.1f} s; "
                f"bound {cluster.stall_bound:.1f} s after any control-plane outage)"
            )
    return violations


def _check_left(cluster: Cluster) -> list[str]:
    violations = []
    for worker, last_epoch in cluster.left_after.items():
        name = worker.host.name
        newer = [
            (at, e["epoch"])
            for other in cluster.workers
            if other is not worker
            for at, e in other.timed_steps()
            if e["epoch"] > last_epoch
        ]
        replaced_at, new_epoch = min(newer) if newer else (None, None)
        for at, event in worker.timed_steps():
            step, epoch = event["step"], event["epoch"]
            if epoch > last_epoch:
                violations.append(f"{name}: committed step {step} in epoch {epoch} after leaving")
            elif replaced_at is not None and at > replaced_at + READ_LAG:
                violations.append(
                    f"{name}: committed step {step} in its old epoch {epoch} "
                    f"{at - replaced_at:.2f} s after the others committed in epoch "
                    f"{new_epoch} without it"
                )
    return violations


__all__ = [
    "CLUSTER_SETTINGS",
    "SLOW_ABOVE",
    "SLOW_BELOW",
    "example_plan",
    "Cluster",
    "EtcdMember",
    "Host",
    "Network",
    "NetworkError",
    "Replica",
    "StatusSample",
    "StatusSampler",
    "Worker",
    "check_invariants",
    "commit_gaps",
    "stall_bound",
    "freeze",
    "kill",
    "namespaces",
    "remove_stale",
    "require_tools",
    "thaw",
]
