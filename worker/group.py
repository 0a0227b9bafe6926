"""The gloo process group of one committed view (epoch), abortable at every wait.

gloo cannot abort a collective: ``abort()`` and ``shutdown()`` return at once
while the blocked call keeps waiting for its timeout. So every blocking step
here (connecting to the bootstrap store, waiting for peers, building the
group, each collective) runs in the background while the caller polls the
``abort`` flag, and a collective is aborted for real by shutting down the
group's own TCP connections (found when the group is built: every rank
publishes its gloo listener in the epoch's store), which makes the blocked
call fail within milliseconds here and on every peer. What cannot be
stopped that way (a build still connecting) is *parked*: kept referenced
until it finishes, at the latest when its own timeout fires, and only then
released. A failed group is released at once: closing its connections is
what makes peers still blocked on it fail fast.

Two timeouts: gloo's own, per collective, is only a backstop (``timeout``
plus the longest busy period a peer may declare); how long a collective may
really wait is asked of ``patience(started)`` while it waits, so a peer that
declared itself busy (evaluating, saving) extends it without a roll call.

A process that used this module must call :func:`wait_parked` before it exits
(an ``atexit`` hook does it too, after closing every group still open): a
gloo group still alive while the interpreter shuts down ends the process with
SIGABRT ("terminate called without an active exception") in a fair share of
exits, whether it is healthy or failed.

Typical use, one group per committed view::

    if rank == 0:
        store, port = host_store(timeout)      # publish `port` out of band
    group = EpochGroup.build(epoch, rank, size, host, port, rank == 0, timeout, abort)
    try:
        group.allreduce_sum(grads)
    except StepAborted:
        ...                                     # discard the step, await the next view
    group.close()
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

import psutil
import torch
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    ProcessGroupGloo,
    ReduceOp,
    Store,
    TCPStore,
    Work,
)

from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError
from rollcall.worker.bootstrap import epoch_store

__all__ = [
    "LOOPBACK",
    "AbortFlag",
    "EpochGroup",
    "Patience",
    "PeerFailed",
    "StepAborted",
    "host_store",
    "leaked_count",
    "parked_count",
    "wait_parked",
]

log = logging.getLogger("rollcall.group")

#: Default address the gloo transport and a hosted store bind to.
LOOPBACK = "127.0.0.1"

T = TypeVar("T")


class AbortFlag(Protocol):
    """What the blocking calls poll: ``threading.Event`` is one."""

    def is_set(self) -> bool: ...


#: ``patience(started)``: the monotonic time until which a wait that began at
#: ``started`` may go on. Asked again at every poll, so it may grow.
Patience = Callable[[float], float]


class StepAborted(RollcallError):
    """The collective was abandoned (abort requested or a peer failed); nothing
    was applied. Discard the step's partial results and wait for the next view."""


class PeerFailed(StepAborted):
    """A peer failed or vanished: its connection was reset or closed, it never
    joined, or the group timed out waiting for it. ``reason`` is the transport's
    own text, e.g. "... Connection reset by peer ..."."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------
# Parking: whatever gloo may still be running is kept alive until it stops.


@dataclass(eq=False)
class _Parked:
    """Objects that must outlive a background operation, and how to tell
    when it is over."""

    what: str
    finished: Callable[[], bool]
    deadline: float  # monotonic time by which its own timeout has ended it
    poll: float  # how often to look whether it finished (its group's abort poll)
    keep: tuple[object, ...] = field(repr=False)


_parked: list[_Parked] = []
_parked_lock = threading.Lock()
_open_groups: weakref.WeakSet[EpochGroup] = weakref.WeakSet()


def _park(
    what: str, finished: Callable[[], bool], timeout: float, config: Config, *keep: object
) -> None:
    """Keep ``keep`` referenced until ``finished()``; the operation is known
    to end within ``timeout`` seconds (and ``config.group_park_grace``)."""
    deadline = time.monotonic() + timeout + config.group_park_grace
    with _parked_lock:
        _parked.append(_Parked(what, finished, deadline, config.group_abort_poll, keep))


def _release_finished() -> list[_Parked]:
    """Drop every parked entry whose operation is over; return the others."""
    with _parked_lock:
        done = [entry for entry in _parked if entry.finished()]
        _parked[:] = [entry for entry in _parked if entry not in done]
        remaining = list(_parked)
    # Dropping the last reference destroys the gloo group (10-20 ms, with
    # the GIL held: gloo joins its threads and closes its connections).
    done.clear()
    return remaining


_leaked: list[str] = []


def _leak(what: str, *keep: object) -> None:
    """Keep ``keep`` alive until the process exits, whatever happens: a
    reference Python never gives back, so neither the interpreter's shutdown
    nor a later cleanup runs their destructors (which would wait for a stuck
    gloo work or abort the process). Exiting with them alive was measured
    clean: the process ends at once with its own exit code."""
    for item in keep:
        if item is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))
    _leaked.append(what)
    log.warning(
        "%s: a collective could not be stopped; the group is left to end with the process",
        what,
    )


def leaked_count() -> int:
    """Groups left alive because a collective of theirs could not be stopped."""
    return len(_leaked)


def parked_count() -> int:
    """How many abandoned groups (or builds) are still blocked; releases the
    ones that are no longer."""
    return len(_release_finished())


def wait_parked(timeout: float) -> bool:
    """Block until every parked operation has finished (at the latest when its
    own timeout fires) and has been released; True if none is left.

    A process that used an EpochGroup must call this before it exits: a gloo
    group still alive when the interpreter shuts down can abort the process
    (SIGABRT), and so can a helper thread that returns from torch during
    shutdown. Returns False early when only operations stuck for good remain.
    Looks every ``group_abort_poll`` of the configs they were parked with.
    """
    give_up = time.monotonic() + timeout
    while remaining := _release_finished():
        now = time.monotonic()
        if now >= give_up or all(entry.deadline <= now for entry in remaining):
            return False
        time.sleep(min(entry.poll for entry in remaining))
    return True


def _release_all_at_exit() -> None:
    """Release the groups still open and wait for what is parked, while the
    interpreter is still intact."""
    for group in list(_open_groups):
        group.close()
    with _parked_lock:
        deadline = max((entry.deadline for entry in _parked), default=0.0)
        waiting = [entry.what for entry in _parked if not entry.finished()]
    if waiting:
        log.warning(
            "exiting: waiting up to %.0f s for blocked gloo or store calls to end: %s",
            max(0.0, deadline - time.monotonic()), waiting,
        )  # fmt: skip
    if not wait_parked(max(0.0, deadline - time.monotonic())):
        stuck = [entry.what for entry in _release_finished()]
        log.warning("exiting while gloo or store calls are still blocked: %s", stuck)
    _hosted.clear()


atexit.register(_release_all_at_exit)


# --------------------------------------------------------------------------
# Running a blocking call in the background, abandoning it on abort.
#
# Failures are returned as StepAborted values by the internal helpers and
# raised only by the public methods, from frames that hold no gloo object: an
# exception's traceback keeps its frames' locals alive, and a group or work
# kept alive that way keeps its sockets open (peers then wait for the timeout
# instead of seeing a reset) and outlives interpreter shutdown (SIGABRT).


class _Call(Generic[T]):
    """``fn()`` on a daemon thread. If the caller abandons it, its result is
    dropped as soon as it exists."""

    def __init__(self, what: str, fn: Callable[[], T]) -> None:
        self.what = what
        self._done = threading.Event()
        self._fn: Callable[[], T] | None = fn
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: T | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name=f"rollcall {what}", daemon=True).start()

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        assert fn is not None
        try:
            result = fn()
        except BaseException as exc:  # handed to the waiting caller, never lost
            with self._lock:
                if not self._abandoned:
                    self._error = exc
        else:
            with self._lock:
                if not self._abandoned:
                    self._result = result
            del result
        self._done.set()

    def join(self, abort: AbortFlag, timeout: float, config: Config) -> T | StepAborted:
        """The call's result, or StepAborted as soon as ``abort`` is set
        (looked at every ``config.group_abort_poll``; the call is then parked
        until it ends, which its own ``timeout`` bounds), or PeerFailed if it
        raised one of torch's runtime errors (StepAborted raised by ``fn`` is
        returned as it is)."""
        while not self._done.wait(config.group_abort_poll):
            if abort.is_set():
                with self._lock:
                    self._abandoned = True
                    self._result = None
                _park(self.what, self._done.is_set, timeout, config)
                return StepAborted(f"{self.what}: aborted")
        error, self._error = self._error, None
        result, self._result = self._result, None
        if error is None:
            assert result is not None
            return result
        if isinstance(error, StepAborted):
            return error
        if isinstance(error, RuntimeError):  # torch's network, store and gloo errors
            return PeerFailed(f"{self.what}: {error}", str(error))
        raise error


# --------------------------------------------------------------------------
# The bootstrap store.

_hosted: dict[int, TCPStore] = {}


def host_store(timeout: float, port: int = 0, host: str = LOOPBACK) -> tuple[TCPStore, int]:
    """Host a bootstrap TCPStore on ``host``:``port`` (0: a free port chosen by
    the kernel); return it and the bound port.

    The view's rank 0 calls this, publishes the port to its peers out of band,
    then passes the port to :meth:`EpochGroup.build` with ``is_store_host=True``
    (the group then owns the store). The socket is bound here and handed to the
    store because TCPStore itself listens on every interface.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = TCPStore(
            host, port, None, True, _delta(timeout),
            wait_for_workers=False, master_listen_fd=listener.fileno(),
        )  # fmt: skip
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now and closes it
    _hosted[port] = store
    return store, port


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _patient(timeout: float) -> Patience:
    """Patience of a wait that may last ``timeout`` seconds, whatever happens."""
    return lambda started: started + timeout


def _await_listener(
    epoch: int,
    host: str,
    port: int,
    started: float,
    patience: Patience,
    abort: AbortFlag,
    config: Config,
) -> None:
    """Return once ``host``:``port`` accepts a TCP connection.

    TCPStore's own client cannot be stopped while it connects: it retries a
    refused connection until its timeout, then sleeps a growing back-off
    (seconds at small timeouts, up to a minute at large ones) and tries once
    more. Abandoned, such a connect outlives the parking bound, and a process
    exiting meanwhile dies with SIGABRT. So the listener is probed here first,
    with short attempts (``config.group_store_probe_attempt``, one every
    ``group_store_probe_interval``) and ``abort`` looked at between them;
    TCPStore only connects to a listener that has just answered (it can
    still die in that window: the connect then takes TCPStore's own time).
    """
    while True:
        if abort.is_set():
            raise StepAborted(f"epoch {epoch}: aborted while connecting to the store")
        left = patience(started) - time.monotonic()
        if left <= 0:
            reason = f"store {host}:{port} does not accept connections"
            raise PeerFailed(f"epoch {epoch}: {reason}", reason)
        try:
            attempt = min(config.group_store_probe_attempt, left)
            socket.create_connection((host, port), timeout=attempt).close()
            return
        except OSError:  # refused, unreachable or timed out: try again until the deadline
            time.sleep(min(config.group_store_probe_interval, max(0.0, left)))


def _meet(
    epoch: int,
    rank: int,
    size: int,
    store_host: str,
    store_port: int,
    hosted: TCPStore | None,
    timeout: float,
    patience: Patience,
    abort: AbortFlag,
    secret: str,
    config: Config,
) -> TCPStore:
    """Connect to the epoch's store (unless this rank hosts it) and wait there
    until every rank has arrived: gloo itself would wait for an absent peer
    until its timeout, unabortably. Runs on a helper thread, because a store
    request to a host that died blocks while the client reconnects."""
    started = time.monotonic()
    if hosted is None:
        _await_listener(epoch, store_host, store_port, started, patience, abort, config)
    store = hosted or TCPStore(
        store_host, store_port, None, False, _delta(timeout), wait_for_workers=False
    )
    scoped = epoch_store(epoch, store, secret)
    scoped.set(f"rollcall/joined/{rank}", "1")
    keys = [f"rollcall/joined/{peer}" for peer in range(size)]
    while not scoped.check(keys):
        if abort.is_set():
            raise StepAborted(f"epoch {epoch}: aborted while waiting for peers")
        if time.monotonic() >= patience(started):
            missing = [peer for peer in range(size) if not scoped.check([keys[peer]])]
            reason = f"ranks {missing} did not join"
            raise PeerFailed(f"epoch {epoch}: {reason}", reason)
        time.sleep(config.group_abort_poll)
    return store


class _Gloo(Protocol):
    """The collectives used here, which ProcessGroupGloo has at run time but
    torch's type stubs declare only on the ProcessGroup wrapper."""

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work: ...


def _gloo_group(store: Store, rank: int, size: int, timeout: float, listen_host: str) -> _Gloo:
    # The private options are the only way to pick the transport's address;
    # the public constructor resolves the hostname and may bind anywhere.
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = _delta(timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=listen_host)]
    return cast(_Gloo, ProcessGroupGloo(store, rank, size, options))


def _tcp_sockets() -> list[Any]:
    return list(psutil.Process().net_connections(kind="tcp"))


@dataclass(frozen=True)
class _Connection:
    """One of the group's TCP connections: its descriptor and both ends, so
    that a descriptor gloo closed and the process reused for another socket
    is never mistaken for it."""

    fd: int
    local: tuple[str, int]
    peer: tuple[str, int]

    def shut_down(self) -> bool:
        """Shut the connection down if the descriptor still holds it; True if
        it did. The descriptor is duplicated first, so the check and the
        shutdown see one and the same socket."""
        try:
            copy = os.dup(self.fd)
        except OSError:
            return False  # closed by gloo already
        sock = socket.socket(fileno=copy)
        try:
            if _endpoint(sock.getsockname()) != self.local:
                return False
            if _endpoint(sock.getpeername()) != self.peer:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:  # not a socket any more, or no longer connected
            return False
        finally:
            sock.close()


def _endpoint(address: Any) -> tuple[str, int]:
    host, port = address[0], address[1]
    return (str(host).removeprefix("::ffff:"), int(port))


def _connections_of(
    before: set[int], after: Sequence[Any], listeners: set[tuple[str, int]]
) -> tuple[tuple[str, int] | None, list[_Connection]]:
    """This rank's gloo listener (the one new listening socket) and the
    group's own connections among ``after`` (psutil's connections): new
    since ``before`` and either accepted on our listener or connected to a
    peer's (``listeners``). gRPC or metrics connections made meanwhile by
    other threads match neither."""
    new = [c for c in after if c.fd not in before and c.fd >= 0]
    own = [c for c in new if c.status == psutil.CONN_LISTEN]
    listener = _endpoint(own[0].laddr) if len(own) == 1 else None
    connections = [
        _Connection(c.fd, _endpoint(c.laddr), _endpoint(c.raddr))
        for c in new
        if c.status == psutil.CONN_ESTABLISHED
        and c.raddr
        and (
            (listener is not None and c.laddr.port == listener[1])
            or _endpoint(c.raddr) in listeners
        )
    ]
    return listener, connections


def _publish_listeners(
    epoch: int, rank: int, size: int, store: TCPStore, listener: tuple[str, int] | None,
    timeout: float, secret: str,
) -> set[tuple[str, int]]:  # fmt: skip
    """Every rank's gloo listener, exchanged through the epoch's store."""
    scoped = epoch_store(epoch, store, secret)
    scoped.set(f"rollcall/gloo/{rank}", "" if listener is None else f"{listener[0]}:{listener[1]}")
    values = scoped.multi_get([f"rollcall/gloo/{peer}" for peer in range(size)])
    found = set()
    for value in values:
        host, _, port = value.decode().rpartition(":")
        if host:
            found.add((host, int(port)))
    return found


# --------------------------------------------------------------------------
# The group.


class EpochGroup:
    """A gloo process group for one committed view (epoch), built directly with
    torch.distributed.ProcessGroupGloo (no global default group, no
    init_process_group). One collective at a time."""

    def __init__(
        self,
        epoch: int,
        rank: int,
        size: int,
        timeout: float,
        abort: AbortFlag,
        pg: _Gloo,
        store: TCPStore,
        connections: Sequence[_Connection] = (),
        patience: Patience | None = None,
        hard_timeout: float | None = None,
        *,
        config: Config,
    ) -> None:
        self.epoch = epoch
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._abort = abort
        self._pg: _Gloo | None = pg
        self._store: TCPStore | None = store
        self._broken: str | None = None
        #: The group's own TCP connections: shutting them down is what aborts
        #: a blocked collective (here and on the peers).
        self._connections = tuple(connections)
        self._patience = patience or _patient(timeout)
        self.hard_timeout = max(timeout, hard_timeout or timeout)
        self._config = config
        _open_groups.add(self)

    @property
    def abortable(self) -> bool:
        """Whether a blocked collective can be aborted at once (the group's
        connections were found); if not, an abandoned one is parked."""
        return bool(self._connections)

    @classmethod
    def build(
        cls,
        epoch: int,
        rank: int,
        size: int,
        store_host: str,
        store_port: int,
        is_store_host: bool,
        timeout: float,
        abort: AbortFlag,
        listen_host: str = LOOPBACK,
        patience: Patience | None = None,
        hard_timeout: float | None = None,
        *,
        secret: str,
        config: Config | None = None,
    ) -> EpochGroup:
        """Connect to the epoch's bootstrap store, wait for all ``size`` ranks
        and build the group; ``listen_host`` is the address gloo binds to.
        Every key and value the ranks exchange is sealed with the view's
        epoch ``secret`` (``rollcall.worker.bootstrap``): a value written by anyone
        without it fails the build as an absent peer would.

        ``patience`` (default: ``timeout`` from the start of each wait) says
        how long a wait for peers may go on, here and in every collective;
        ``hard_timeout`` is gloo's own per-collective timeout, a backstop
        that must cover the longest patience. ``config`` (default:
        ``Config()``) says how often waits look at ``abort`` and how long an
        abandoned wait is parked (``group_*``). Raises StepAborted within
        ``config.group_abort_poll`` once ``abort`` is set, and PeerFailed if
        a peer is absent or fails.
        """
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        outcome = cls._build(
            epoch, rank, size, store_host, store_port, is_store_host, timeout, abort, listen_host,
            patience or _patient(timeout), hard_timeout, secret, config or Config(),
        )  # fmt: skip
        if isinstance(outcome, StepAborted):
            raise outcome
        return outcome

    @classmethod
    def _build(
        cls,
        epoch: int,
        rank: int,
        size: int,
        store_host: str,
        store_port: int,
        is_store_host: bool,
        timeout: float,
        abort: AbortFlag,
        listen_host: str,
        patience: Patience,
        hard_timeout: float | None,
        secret: str,
        config: Config,
    ) -> EpochGroup | StepAborted:
        hosted = None
        if is_store_host:
            if store_port not in _hosted:
                host_store(timeout, store_port, store_host)
            hosted = _hosted.pop(store_port)
        if abort.is_set():
            return StepAborted(f"epoch {epoch}: aborted before building")
        store = _Call(
            f"epoch {epoch} rendezvous",
            lambda: _meet(
                epoch,
                rank,
                size,
                store_host,
                store_port,
                hosted,
                timeout,
                patience,
                abort,
                secret,
                config,
            ),
        ).join(abort, timeout, config)
        if isinstance(store, StepAborted):
            return store
        scoped = epoch_store(epoch, store, secret)
        before = {c.fd for c in _tcp_sockets()}
        pg = _Call(
            f"epoch {epoch} group",
            lambda: _gloo_group(scoped, rank, size, timeout, listen_host),
        ).join(abort, timeout, config)
        if isinstance(pg, StepAborted):
            return pg
        after = _tcp_sockets()
        listener, _ = _connections_of(before, after, set())
        peers = _Call(
            f"epoch {epoch} listeners",
            lambda: _publish_listeners(epoch, rank, size, store, listener, timeout, secret),
        ).join(abort, timeout, config)
        if isinstance(peers, StepAborted):
            cls(epoch, rank, size, timeout, abort, pg, store, config=config).close()
            return peers
        _, connections = _connections_of(before, after, peers)
        if len(connections) != size - 1:
            # Not every pair was found (another thread's socket churn, or
            # gloo's lazy init): an abandoned collective must then be parked
            # until gloo's own timeout ends it, so that timeout stays short
            # (busy periods beyond it cannot be honoured by this group).
            log.warning(
                "epoch %d: %d of %d gloo connections found; collectives wait at most %.0f s "
                "and aborted ones are parked", epoch, len(connections), size - 1, timeout,
            )  # fmt: skip
            connections, hard_timeout = [], timeout
        return cls(
            epoch, rank, size, timeout, abort, pg, store, connections, patience, hard_timeout,
            config=config,
        )  # fmt: skip

    @property
    def usable(self) -> bool:
        """False once a collective failed or was abandoned, and after close()."""
        return self._pg is not None and self._broken is None

    def allreduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` in place across the group."""
        self.allreduce(tensors, ReduceOp.SUM)

    def allreduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> None:
        """Reduce ``tensors`` in place across the group with ``op`` (SUM,
        MAX, MIN, PRODUCT).

        The tensors are packed into one buffer per dtype, so gloo works on a
        private copy: after StepAborted/PeerFailed they are unspecified
        (discard them), and a parked collective never writes into them later.
        """
        buffers = _pack(tensors)

        def start(pg: _Gloo) -> list[Work]:
            works = []
            for buffer in buffers:
                opts = AllreduceOptions()
                opts.reduceOp = op  # type: ignore[assignment]  # stubs: ReduceOp, not RedOpType
                opts.timeout = _delta(self.hard_timeout)
                works.append(pg.allreduce([buffer], opts))
            return works

        failed = self._collective("all-reduce", start, buffers)
        if failed is not None:
            raise failed
        _unpack(buffers, tensors)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values; same abort rules
        as :meth:`allreduce`."""
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast source {src} outside a group of {self.size}")
        buffers = _pack(tensors) if self.rank == src else _empty_packed(tensors)

        def start(pg: _Gloo) -> list[Work]:
            works = []
            for buffer in buffers:
                opts = BroadcastOptions()
                opts.rootRank = src
                opts.rootTensor = 0
                opts.timeout = _delta(self.hard_timeout)
                works.append(pg.broadcast([buffer], opts))
            return works

        failed = self._collective("broadcast", start, buffers)
        if failed is not None:
            raise failed
        if self.rank != src:
            _unpack(buffers, tensors)

    def close(self) -> None:
        """Release the group and the store it hosts. Safe to call twice."""
        self._release([], [])

    def _collective(
        self,
        what: str,
        start: Callable[[_Gloo], list[Work]],
        buffers: list[torch.Tensor],
    ) -> StepAborted | None:
        """Run the works ``start`` issues; None once all succeeded. Otherwise
        the group is released (or parked while a work still runs) and the
        reason returned."""
        if self._pg is None or self._broken is not None:
            reason = self._broken or "closed"
            return StepAborted(f"epoch {self.epoch}: group unusable ({reason})")
        if self._abort.is_set():
            return StepAborted(f"epoch {self.epoch}: aborted before the {what}")
        if _parked:
            _release_finished()
        started = time.monotonic()
        works = start(self._pg)
        poll = _delta(self._config.group_abort_poll)
        for work in works:
            while True:
                # The wait sleeps in C++ without the GIL and is woken by gloo
                # itself: no Python callback has to run on gloo's thread (it
                # would need the GIL, and on a busy machine wait for it) and
                # no other thread is woken on the success path.
                try:
                    work.wait(poll)
                    break
                except RuntimeError:
                    if work.is_completed():  # failed, or ended just after the timeout
                        failure = _failure_of(work)
                        if failure is None:
                            break
                        self._broken = f"{what} failed"
                        # The collective's other works (one per dtype) may
                        # still wait on peers: stop them too.
                        self._abandon(works, buffers)
                        return PeerFailed(f"epoch {self.epoch}: {what} failed: {failure}", failure)
                if self._abort.is_set():
                    self._broken = f"{what} aborted"
                    self._abandon(works, buffers)
                    return StepAborted(f"epoch {self.epoch}: {what} aborted")
                if time.monotonic() >= self._patience(started):
                    waited = time.monotonic() - started
                    reason = f"no answer from a peer within {waited:.0f} s"
                    self._broken = f"{what} timed out"
                    self._abandon(works, buffers)
                    return PeerFailed(f"epoch {self.epoch}: {what}: {reason}", reason)
        return None

    def _abandon(self, works: list[Work], buffers: list[torch.Tensor]) -> None:
        """Stop ``works`` by shutting down the group's connections (they fail
        within milliseconds, and so do the peers' halves), then release.

        gloo has been seen to leave a work waiting after every connection of
        its group was gone (a partition healed under it): such a group is
        left alive for good instead (``_leak``), since waiting for its own
        timeout, the long backstop, would hold the process for up to an hour
        at exit, and destroying it would block or abort the process."""
        for connection in self._connections:
            connection.shut_down()
        if not self._connections:
            self._release(works, buffers)
            return
        settle = time.monotonic() + self._config.group_abort_settle
        while any(not w.is_completed() for w in works) and time.monotonic() < settle:
            time.sleep(self._config.group_abort_settle_poll)
        pending = [work for work in works if not work.is_completed()]
        if not pending:
            self._release(works, buffers)
            return
        pg, store = self._pg, self._store
        self._pg = self._store = None
        _open_groups.discard(self)
        _leak(f"epoch {self.epoch} group", pg, store, *pending, *buffers)

    def _release(self, works: list[Work], buffers: list[torch.Tensor]) -> None:
        """Destroy the group now if none of ``works`` still runs (which also
        tells peers blocked on it, by resetting their connections); otherwise
        park it with them until they end."""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        _open_groups.discard(self)
        pending = [work for work in works if not work.is_completed()]
        if pending and pg is not None:
            _park(
                f"epoch {self.epoch} group",
                lambda: all(work.is_completed() for work in pending),
                self.hard_timeout,
                self._config,
                pg,
                store,
                pending,
                list(buffers),
            )


def _failure_of(work: Work) -> str | None:
    """Why the completed ``work`` failed, or None if it succeeded (it ended
    just after a wait on it timed out)."""
    try:
        work.wait()
    except RuntimeError as exc:
        return str(exc)
    return None


def _pack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One flat copy per dtype, in order of first appearance."""
    return [torch.cat([t.reshape(-1) for t in same]) for same in _by_dtype(tensors).values()]


def _empty_packed(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [
        torch.empty(sum(t.numel() for t in same), dtype=dtype)
        for dtype, same in _by_dtype(tensors).items()
    ]


def _unpack(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    for buffer, same in zip(buffers, _by_dtype(tensors).values(), strict=True):
        offset = 0
        for tensor in same:
            tensor.copy_(buffer[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups
