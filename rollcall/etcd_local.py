"""Real etcd servers on loopback, for development and tests.

:class:`LocalEtcd` runs one ``etcd`` process, :class:`LocalEtcdCluster` runs a
cluster of them. Both listen on 127.0.0.1 only, keep etcd's log in a file
(shown in the error when a start fails), and make sure no etcd outlives the
Python process that started it:

- each child is started through ``rollcall.tether``, which sets
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills it when its parent
  dies, even by SIGKILL. The signal is tied to the *thread* that started the
  child: a server started from a thread that exits while the process lives on
  is killed at that moment. Start servers from a thread that lives as long as
  you need them (the main thread, or pytest's);
- an ``atexit`` hook kills whatever is still running at a normal exit.

Timing flags favour quick starts and quick failover on loopback: cluster
members use a 50 ms heartbeat and a 500 ms election timeout; a lone server
(no ``initial_cluster``) uses 10 ms / 100 ms, because it waits out a random
share of one election timeout before it elects itself at every start. Both
keep etcd's minimum lease TTL at 1 s (1.5 election timeouts, rounded up), below
anything rollcall asks for. etcd renews every lease to its full TTL (plus about
one election timeout) whenever a leader takes office, including after a
restart: leases survive an etcd outage, however long.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc
import psutil
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from rollcall.rendezvous.etcd_auth import answered_without_credentials
from rollcall.tether import tethered

#: Raft timing of cluster members: quick failover on loopback.
_CLUSTER_HEARTBEAT_MS = 50
_CLUSTER_ELECTION_MS = 500
#: A lone member only waits out one (randomised) election timeout at start-up.
_SINGLE_HEARTBEAT_MS = 10
_SINGLE_ELECTION_MS = 100
_SNAPSHOT_COUNT = 10_000
#: etcd keeps every revision of every key until it is compacted; rollcall
#: writes a new revision at every view change, progress write and lease
#: record, so the history grows without bound (finding: etcd's space quota
#: then refuses every write). Periodic auto-compaction keeps this much
#: history (etcd 3.4 compacts every retention period when it is under an
#: hour): a watch more than this far behind resynchronises by reading the
#: key again (``rollcall.rendezvous.etcd_client._KeyWatch``). Freed pages are reused, so
#: the database file stays bounded without defragmentation.
AUTO_COMPACTION_RETENTION = "5m"
#: etcd's backend quota (its default, stated): beyond it etcd raises a
#: NOSPACE alarm and refuses writes until compacted, defragmented and disarmed.
QUOTA_BACKEND_BYTES = 2 * 1024**3
_STOP_GRACE = 3.0
_POLL_INTERVAL = 0.02
#: pause()/resume() wait at most this long for the kernel to apply the signal.
_SIGNAL_SETTLE = 1.0
_LOG_TAIL_LINES = 30
_LOG_NAME = "etcd.log"
# Short gRPC reconnect back-off so the readiness poll notices a fresh server
# within tens of milliseconds instead of gRPC's default second.
_READINESS_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]

_MISSING_BINARY = (
    "etcd binary {binary!r} not found: install the Debian package etcd-server "
    "(apt-get install etcd-server) or run scripts/setup"
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    return free_ports(1)[0]


def free_ports(count: int, besides: Iterable[int] = ()) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago,
    none of them in ``besides``. Picked one at a time, the OS may hand out the
    same port again as soon as its probe closes, so every probe stays bound
    until all are picked."""
    avoid = set(besides)
    ports: list[int] = []
    with contextlib.ExitStack() as probes:
        while len(ports) < count:
            sock = probes.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
    return ports


@dataclass(frozen=True)
class EtcdServerTLS:
    """TLS of etcd's client port (peers stay on plain HTTP on loopback).

    The readiness check connects with ``trusted_ca_file`` and, when
    ``client_cert_auth`` is on, presents the server's own certificate and key
    as its client certificate, so that certificate must allow client
    authentication (no extended key usage, or both serverAuth and clientAuth).
    """

    cert_file: str
    key_file: str
    trusted_ca_file: str
    client_cert_auth: bool = False


_live_lock = threading.Lock()
_live: set[LocalEtcd] = set()
_live_clusters: set[LocalEtcdCluster] = set()


def _kill_all_at_exit() -> None:
    with _live_lock:
        clusters, servers = list(_live_clusters), list(_live)
    for cluster in clusters:
        cluster.stop()
    for server in servers:
        server.stop(grace=0.0)


atexit.register(_kill_all_at_exit)


def child_processes(pid: int) -> dict[int, str]:
    """Live (not zombie) child processes of ``pid``: pid -> command name."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return {}
    found = {}
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = child.name()
        except psutil.Error:  # gone since it was listed
            continue
    return found


def process_status(pid: int) -> str | None:
    """The status of process ``pid`` (``psutil.STATUS_RUNNING``,
    ``STATUS_STOPPED``, ``STATUS_ZOMBIE``...), None if there is no such
    process."""
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    return process_status(pid) not in (None, psutil.STATUS_ZOMBIE)


def await_stopped(pid: int, stopped: bool, settle: float = _SIGNAL_SETTLE) -> bool:
    """After SIGSTOP (``stopped``) or SIGCONT, wait until the kernel reports
    process ``pid`` stopped (once every thread has stopped) or running
    again; signals are delivered asynchronously. False if it did not within
    ``settle`` seconds; True also if the process is gone."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        status = process_status(pid)
        if status is None or (status == psutil.STATUS_STOPPED) == stopped:
            return True
        time.sleep(0.001)
    return False


def running_etcd_children() -> list[int]:
    """Pids of ``etcd`` processes whose parent is this process (leak check)."""
    return sorted(pid for pid, name in child_processes(os.getpid()).items() if name == "etcd")


def etcd_flags(
    name: str,
    data_dir: Path,
    client_url: str,
    peer_url: str,
    initial_cluster: str,
    cluster_token: str,
    alone: bool,
    cluster_state: str = "new",
    heartbeat_ms: int | None = None,
    election_ms: int | None = None,
    compaction_retention: str = AUTO_COMPACTION_RETENTION,
) -> list[str]:
    """The command-line flags of one etcd member (without the binary):
    plaintext URLs, the raft timing for a lone member or a cluster member
    unless given, periodic auto-compaction keeping ``compaction_retention``
    of history, warnings only, on stderr."""
    single = (_SINGLE_HEARTBEAT_MS, _SINGLE_ELECTION_MS)
    timing = single if alone else (_CLUSTER_HEARTBEAT_MS, _CLUSTER_ELECTION_MS)
    return [
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={initial_cluster}",
        f"--initial-cluster-state={cluster_state}",
        f"--initial-cluster-token={cluster_token}",
        f"--heartbeat-interval={heartbeat_ms or timing[0]}",
        f"--election-timeout={election_ms or timing[1]}",
        f"--snapshot-count={_SNAPSHOT_COUNT}",
        "--auto-compaction-mode=periodic",
        f"--auto-compaction-retention={compaction_retention}",
        f"--quota-backend-bytes={QUOTA_BACKEND_BYTES}",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]


class LocalEtcd:
    """One etcd server on 127.0.0.1.

    ``stop()`` ends it for good (and deletes the data directory if this object
    created it); ``kill()`` crashes it and keeps its data and ports, so that
    ``start()`` brings the same member back.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "rollcall-etcd",
        binary: str = "etcd",
        initial_cluster: str | None = None,
        cluster_state: str = "new",
        tls: EtcdServerTLS | None = None,
        cluster_token: str | None = None,
        heartbeat_ms: int | None = None,
        election_ms: int | None = None,
        compaction_retention: str = AUTO_COMPACTION_RETENTION,
        avoid: Iterable[int] = (),
    ) -> None:
        self._compaction_retention = compaction_retention
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._binary = binary
        self._owns_dir = data_dir is None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._ports_chosen = client_port == 0 and peer_port == 0
        # Ports picked here are none of ``avoid`` (ports the caller binds
        # after etcd starts), also when a start picks again.
        self._avoid = frozenset(avoid)
        missing = (client_port, peer_port).count(0)
        picked = iter(free_ports(missing, besides={client_port, peer_port, *self._avoid}))
        self.client_port = client_port or next(picked)
        self.peer_port = peer_port or next(picked)
        self.name = name
        self._initial_cluster = initial_cluster
        self._cluster_state = cluster_state
        self._cluster_token = cluster_token or f"rollcall-{uuid.uuid4().hex[:12]}"
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._started_once = False

    # --- addresses ----------------------------------------------------------
    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def data_dir(self) -> Path:
        """etcd's data directory (created on first use when none was given)."""
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        return self._data_dir

    @property
    def log_file(self) -> Path:
        return self.data_dir / _LOG_NAME

    @property
    def pid(self) -> int | None:
        """Pid of the running server, ``None`` when it is not running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self.pid is not None

    # --- life cycle ---------------------------------------------------------
    def start(self, timeout: float = 15.0) -> LocalEtcd:
        """Launch etcd and wait until it serves a linearizable read.

        Raises ``RuntimeError`` with the tail of etcd's log if it exits or is
        not ready within ``timeout`` seconds (the process is then killed). On
        a first start with ports picked here, in a data directory that holds
        no etcd data yet, a port taken in the meantime by someone else is
        retried with new ports (a directory that holds data is never wiped).
        """
        fresh = not self._started_once and not (self.data_dir / "member").exists()
        attempts = 3
        for attempt in range(1, attempts + 1):
            self.launch()
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError as exc:
                taken = "address already in use" in str(exc)
                if attempt == attempts or not (fresh and self._ports_chosen and taken):
                    raise
                self.wipe_data()  # what the failed start may have written
                self.client_port, self.peer_port = free_ports(2, besides=self._avoid)
        raise AssertionError("unreachable")  # pragma: no cover

    def launch(self) -> None:
        """Start the etcd process without waiting for it (see ``wait_ready``)."""
        if self.running:
            raise RuntimeError(f"etcd {self.name} is already running (pid {self.pid})")
        binary = shutil.which(self._binary)
        if binary is None:
            raise FileNotFoundError(_MISSING_BINARY.format(binary=self._binary))
        # 0700: etcd warns about anything more open.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(log_fd, "ab") as log:
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                tethered([binary, *self._flags()]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # Keep terminal signals (Ctrl-C) for the parent, which cleans up.
                start_new_session=True,
            )
        with _live_lock:
            _live.add(self)

    def _flags(self) -> list[str]:
        flags = etcd_flags(
            self.name, self.data_dir, self.endpoint, self.peer_url,
            self._initial_cluster or f"{self.name}={self.peer_url}", self._cluster_token,
            alone=self._initial_cluster is None, cluster_state=self._cluster_state,
            heartbeat_ms=self._heartbeat_ms, election_ms=self._election_ms,
            compaction_retention=self._compaction_retention,
        )  # fmt: skip
        if self.tls is not None:
            flags += [f"--cert-file={self.tls.cert_file}", f"--key-file={self.tls.key_file}"]
            if self.tls.client_cert_auth:
                # etcd 3.4 demands client certificates whenever it is given a
                # trusted CA, whatever --client-cert-auth says.
                flags += [f"--trusted-ca-file={self.tls.trusted_ca_file}", "--client-cert-auth"]
        return flags

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Block until the server answers a linearizable read (so it has a
        leader), or raise ``RuntimeError`` with the log tail."""
        if self._proc is None:
            raise RuntimeError(f"etcd {self.name} was never launched")
        deadline = time.monotonic() + timeout
        with self._readiness_client() as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"etcd {self.name} exited with code {code} during start-up; "
                        f"log tail:\n{self.log_tail()}"
                    )
                try:
                    client.get_response("/rollcall/readiness")
                    self._started_once = True
                    return
                except grpc.RpcError as exc:
                    # With authentication on, etcd refuses the anonymous
                    # read only after it served it as far as a leader.
                    if answered_without_credentials(exc):
                        self._started_once = True
                        return
                except Exception:  # noqa: BLE001 - any failure means "not yet"
                    pass
                if time.monotonic() >= deadline:
                    self.kill()
                    raise RuntimeError(
                        f"etcd {self.name} not ready within {timeout:.1f} s at "
                        f"{self.endpoint}; log tail:\n{self.log_tail()}"
                    )
                time.sleep(_POLL_INTERVAL)

    @contextlib.contextmanager
    def _readiness_client(self) -> Iterator[MultiEndpointEtcd3Client]:
        creds = None
        if self.tls is not None:
            if self.tls.client_cert_auth:
                creds = MultiEndpointEtcd3Client.get_secure_creds(
                    self.tls.trusted_ca_file, self.tls.key_file, self.tls.cert_file
                )
            else:
                creds = MultiEndpointEtcd3Client.get_secure_creds(self.tls.trusted_ca_file)
        endpoint = Endpoint(
            "127.0.0.1",
            self.client_port,
            secure=self.tls is not None,
            creds=creds,
            # pyetcd's default 300 s would shun the endpoint after the first
            # refused connection.
            time_retry=0.0,
            opts=_READINESS_GRPC_OPTIONS,
        )
        client = MultiEndpointEtcd3Client([endpoint], timeout=0.5, failover=True)
        try:
            yield client
        finally:
            client.close()

    def wait_peer_serving(self, deadline: float) -> None:
        """Wait (until the ``time.monotonic()`` ``deadline`` at most) for the
        peer port to answer HTTP, or for the process to exit.

        Members of a new cluster are launched one after the other with this
        in between: a new member asks every peer whether it was already
        bootstrapped, and a peer whose port is bound but not yet served makes
        that question hang for etcd's 1 s bootstrap timeout, per peer.
        """
        url = f"{self.peer_url}/version"
        while time.monotonic() < deadline and self.running:
            try:
                with urllib.request.urlopen(url, timeout=0.2) as response:
                    response.read()
                return
            except OSError:
                time.sleep(_POLL_INTERVAL)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines etcd wrote since its latest launch."""
        if self._data_dir is None:
            return "(no log: never launched)"
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def kill(self) -> None:
        """SIGKILL the server (a crash); data and ports are kept for ``start()``."""
        self._signal_and_reap(signal.SIGKILL, grace=0.0)

    def stop(self, grace: float = _STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (at once if ``grace``
        is 0); delete the data directory if this object created it.
        Idempotent."""
        self._signal_and_reap(signal.SIGTERM if grace > 0 else signal.SIGKILL, grace)
        if self._owns_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._started_once = False

    def _signal_and_reap(self, sig: signal.Signals, grace: float) -> None:
        self._signal(sig)
        self._reap(grace)

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
                # A paused server handles SIGTERM only once continued.
                proc.send_signal(signal.SIGCONT)

    def _reap(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the process, then SIGKILL it."""
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self._proc = None
        with _live_lock:
            _live.discard(self)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing. Returns
        once the kernel reports the process stopped."""
        self._signal_and_await(signal.SIGSTOP, stopped=True)

    def resume(self) -> None:
        """SIGCONT after ``pause()``; returns once the process runs again."""
        self._signal_and_await(signal.SIGCONT, stopped=False)

    def _signal_and_await(self, sig: signal.Signals, stopped: bool) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        await_stopped(proc.pid, stopped)

    def wipe_data(self) -> None:
        """Forget etcd's state (the server must not be running)."""
        if self.running:
            raise RuntimeError(f"etcd {self.name} is running; kill() or stop() it first")
        shutil.rmtree(self.data_dir / "member", ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEtcd({self.name!r}, {self.endpoint}, pid={self.pid})"


class LocalEtcdCluster:
    """``size`` etcd members on loopback forming one cluster.

    All members are launched before any is waited for, since none can answer
    before a quorum is up. ``kill(i)``/``start(i)`` crash and restart member
    ``i`` with its data and ports.
    """

    def __init__(
        self,
        size: int = 3,
        binary: str = "etcd",
        base_dir: Path | None = None,
        tls: EtcdServerTLS | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"cluster size must be >= 1, got {size}")
        self._size = size
        self._binary = binary
        self._owns_dir = base_dir is None
        self._base_dir = base_dir
        self._tls = tls
        self.members: list[LocalEtcd] = []

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, i: int | None = None, timeout: float = 15.0) -> LocalEtcdCluster:
        """Start the whole cluster (``i`` is None) or restart member ``i``."""
        if i is not None:
            self.members[i].start(timeout)
            return self
        if any(m.running for m in self.members):
            raise RuntimeError("cluster is already running; stop() it first")
        with _live_lock:
            _live_clusters.add(self)
        for _ in range(3):
            self._create_members()
            deadline = time.monotonic() + timeout
            for member in self.members:
                member.launch()
                member.wait_peer_serving(deadline)
            try:
                for member in self.members:
                    member.wait_ready(max(0.1, deadline - time.monotonic()))
                return self
            except RuntimeError as exc:
                for member in self.members:
                    member.kill()
                    member.wipe_data()
                if "address already in use" not in str(exc):
                    self.stop()
                    raise
        raise RuntimeError("could not find free ports for the etcd cluster")

    @property
    def base_dir(self) -> Path | None:
        """Directory holding the members' data directories (once started)."""
        return self._base_dir

    def _create_members(self) -> None:
        if self._base_dir is None:
            self._base_dir = Path(tempfile.mkdtemp(prefix="rollcall-etcd-cluster-"))
        token = f"rollcall-{uuid.uuid4().hex[:12]}"
        names = [f"rollcall-etcd-{i}" for i in range(self._size)]
        picked = free_ports(2 * len(names))
        ports = list(zip(picked[::2], picked[1::2], strict=True))
        initial = ",".join(
            f"{name}=http://127.0.0.1:{peer}" for name, (_, peer) in zip(names, ports, strict=True)
        )
        self.members = [
            LocalEtcd(
                data_dir=self._base_dir / name,
                client_port=client,
                peer_port=peer,
                name=name,
                binary=self._binary,
                initial_cluster=initial,
                tls=self._tls,
                cluster_token=token,
            )
            for name, (client, peer) in zip(names, ports, strict=True)
        ]

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``; ``start(i)`` brings it back with its data."""
        self.members[i].kill()

    def stop(self) -> None:
        """Kill every member and delete the data if this object created it.

        SIGKILL, not SIGTERM: etcd is crash-safe, and a leader told to stop
        while its followers stop too waits seconds for a leadership transfer
        that nobody can take."""
        for member in self.members:
            member.kill()
        if self._owns_dir and self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)
            self._base_dir = None
        with _live_lock:
            _live_clusters.discard(self)

    def __enter__(self) -> LocalEtcdCluster:
        if not any(m.running for m in self.members):
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEtcdCluster({self.endpoints})"


__all__ = [
    "EtcdServerTLS",
    "LocalEtcd",
    "LocalEtcdCluster",
    "free_port",
    "free_ports",
    "running_etcd_children",
]
