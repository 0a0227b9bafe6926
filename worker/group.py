"""The gloo process group of one committed view (epoch), abortable at every wait.

gloo cannot abort a collective: ``abort()`` and ``shutdown()`` return at once
while the blocked call keeps waiting for its timeout. So every blocking step
here (meeting at the bootstrap store, ``rollcall.worker.bootstrap_store``;
building the group; each collective) runs in the background
(``rollcall.worker.background``) while the caller polls the ``abort`` flag,
and a collective is aborted for real by shutting down the group's own TCP
connections (``rollcall.worker.connections``: found when the group is built,
every rank publishing its gloo listener in the epoch's store), which makes
the blocked call fail within milliseconds here and on every peer. What
cannot be stopped that way (a build still connecting) is *parked*
(``rollcall.worker.parking``): kept referenced until it finishes, at the
latest when its own timeout fires, and only then released. A failed group
is released at once: closing its connections is what makes peers still
blocked on it fail fast.

Two timeouts: gloo's own, per collective, is only a backstop (``timeout``
plus the longest busy period a peer may declare); how long a collective may
really wait is asked of ``patience(started)`` while it waits, so a peer that
declared itself busy (evaluating, saving) extends it without a roll call.

A process that used this module must call
:func:`rollcall.worker.parking.wait_parked` before it exits (an ``atexit``
hook here does it too, after closing every group still open): a gloo group
still alive while the interpreter shuts down ends the process with SIGABRT
("terminate called without an active exception") in a fair share of exits,
whether it is healthy or failed.

Typical use, one group per committed view::

    if rank == 0:
        store, port = host_store(timeout)      # publish `port` out of band
    group = EpochGroup.build(epoch, rank, size, host, port, rank == 0, timeout, abort,
                             secret=secret, config=config)
    try:
        group.allreduce_sum(grads)
    except StepAborted:
        ...                                     # discard the step, await the next view
    group.close()
"""

from __future__ import annotations

import atexit
import datetime
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch._C._distributed_c10d import AllgatherOptions, GatherOptions
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
from rollcall.worker.abort import AbortFlag, Patience, PeerFailed, StepAborted, patient
from rollcall.worker.background import BackgroundCall
from rollcall.worker.bootstrap import epoch_store
from rollcall.worker.bootstrap_store import (
    LOOPBACK,
    forget_hosted,
    host_store,
    meet,
    take_hosted,
)
from rollcall.worker.connections import Connection, connections_of, socket_ids, tcp_sockets
from rollcall.worker.parking import leak, park, sweep, wait_at_exit

__all__ = ["EpochGroup"]

log = logging.getLogger("rollcall.group")

_open_groups: weakref.WeakSet[EpochGroup] = weakref.WeakSet()


def _release_all_at_exit() -> None:
    """Release the groups still open and wait for what is parked, while the
    interpreter is still intact."""
    for group in list(_open_groups):
        group.close()
    wait_at_exit()
    forget_hosted()


atexit.register(_release_all_at_exit)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _Gloo(Protocol):
    """The collectives used here, which ProcessGroupGloo has at run time but
    torch's type stubs declare only on the ProcessGroup wrapper."""

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> Work: ...
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> Work: ...
    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
    ) -> Work: ...


def _device(listen_host: str) -> Any:
    """A gloo TCP device bound to ``listen_host``: its listener exists from
    here on, so its address can travel with the rank's arrival at the store."""
    return ProcessGroupGloo.create_device(hostname=listen_host)


def _gloo_group(store: Store, rank: int, size: int, timeout: float, device: Any) -> _Gloo:
    # The private options are the only way to pick the transport's address;
    # the public constructor resolves the hostname and may bind anywhere.
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = _delta(timeout)
    options._devices = [device]
    return cast(_Gloo, ProcessGroupGloo(store, rank, size, options))


# --------------------------------------------------------------------------
# The group.


class EpochGroup:
    """A gloo process group for one committed view (epoch), built directly with
    torch.distributed.ProcessGroupGloo (no global default group, no
    init_process_group). Its calls block until the collective is done, but for
    ``start_allreduce_sum``, which several may have in flight (``finish``)."""

    def __init__(
        self,
        epoch: int,
        rank: int,
        size: int,
        timeout: float,
        abort: AbortFlag,
        pg: _Gloo,
        store: TCPStore,
        connections: Sequence[Connection] = (),
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
        self._patience = patience or patient(timeout)
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
            patience or patient(timeout), hard_timeout, secret, config or Config(),
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
        started = time.perf_counter()
        hosted = None
        if is_store_host:
            hosted = take_hosted(store_port)
            if hosted is None:
                host_store(timeout, store_port, store_host)
                hosted = take_hosted(store_port)
        if abort.is_set():
            return StepAborted(f"epoch {epoch}: aborted before building")
        # The device (and so this rank's gloo listener) first: its address
        # travels with this rank's arrival at the store, so that no second
        # exchange is needed once gloo has connected.
        before = socket_ids()
        device = _device(listen_host)
        listener, _ = connections_of(tcp_sockets(skip=before), set())
        met = BackgroundCall(
            f"epoch {epoch} rendezvous",
            lambda: meet(
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
                listener,
            ),
        ).join(abort, timeout, config)
        if isinstance(met, StepAborted):
            return met
        store, peers = met
        met_at = time.perf_counter()
        scoped = epoch_store(epoch, store, secret)
        pg = BackgroundCall(
            f"epoch {epoch} group",
            lambda: _gloo_group(scoped, rank, size, timeout, device),
        ).join(abort, timeout, config)
        if isinstance(pg, StepAborted):
            return pg
        built = time.perf_counter()
        # The listener found when the device was made: another thread may
        # have opened a listening socket since (a data channel, asked for
        # by a joiner while this group builds).
        _, connections = connections_of(tcp_sockets(skip=before), peers, listener)
        log.debug(
            "epoch %d: group of %d built in %.1f ms (%.1f ms meeting every rank at the store, "
            "%.1f ms gloo's own build)", epoch, size, (time.perf_counter() - started) * 1000,
            (met_at - started) * 1000, (built - met_at) * 1000,
        )  # fmt: skip
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

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (all of one shape and dtype), in rank
        order; same abort rules as :meth:`allreduce` (``tensor`` itself is
        never written)."""
        source = tensor.detach().reshape(-1).clone()
        outputs = [torch.empty_like(source) for _ in range(self.size)]

        def start(pg: _Gloo) -> list[Work]:
            opts = AllgatherOptions()
            opts.timeout = _delta(self.hard_timeout)
            return [pg.allgather([outputs], [source], opts)]

        failed = self._collective("all-gather", start, [source, *outputs])
        if failed is not None:
            raise failed
        return [out.view_as(tensor) for out in outputs]

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (all of one shape and dtype) at rank
        ``dst``, in rank order (None on the other ranks); same abort rules
        as :meth:`allreduce`."""
        if not 0 <= dst < self.size:
            raise ValueError(f"gather destination {dst} outside a group of {self.size}")
        source = tensor.detach().reshape(-1).clone()
        outputs = [torch.empty_like(source) for _ in range(self.size)] if self.rank == dst else []

        def start(pg: _Gloo) -> list[Work]:
            opts = GatherOptions()
            opts.rootRank = dst
            opts.timeout = _delta(self.hard_timeout)
            return [pg.gather([outputs] if outputs else [], [source], opts)]

        failed = self._collective("gather", start, [source, *outputs])
        if failed is not None:
            raise failed
        return [out.view_as(tensor) for out in outputs] if self.rank == dst else None

    def close(self) -> None:
        """Release the group and the store it hosts. Safe to call twice."""
        self._release([], [])

    def start_allreduce_sum(self, buffer: torch.Tensor) -> Pending:
        """Start summing ``buffer`` (contiguous) in place across the group
        and return at once; :meth:`finish` waits for it. Several may be in
        flight; every rank must start them in the same order. Raises
        StepAborted if the group is unusable or the abort is set."""
        def start(pg: _Gloo) -> list[Work]:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
            opts.timeout = _delta(self.hard_timeout)
            return [pg.allreduce([buffer], opts)]

        works = self._start("all-reduce", start)
        if isinstance(works, StepAborted):
            raise works
        return Pending(works, [buffer], time.monotonic())

    def finish(self, pending: Sequence[Pending]) -> None:
        """Wait for collectives started with ``start_*`` (same abort and
        patience rules as :meth:`allreduce`). On StepAborted or PeerFailed
        every one of them is abandoned and the group with them: their
        buffers are then unspecified, and may still be written while the
        group is parked (never reuse them)."""
        works = [w for p in pending for w in p.works]
        buffers = [b for p in pending for b in p.buffers]
        started = min((p.started for p in pending), default=time.monotonic())
        failed = self._wait("all-reduce", works, buffers, started)
        if failed is not None:
            raise failed

    def _start(
        self, what: str, start: Callable[[_Gloo], list[Work]]
    ) -> list[Work] | StepAborted:
        if self._pg is None or self._broken is not None:
            reason = self._broken or "closed"
            return StepAborted(f"epoch {self.epoch}: group unusable ({reason})")
        if self._abort.is_set():
            return StepAborted(f"epoch {self.epoch}: aborted before the {what}")
        sweep()
        return start(self._pg)

    def _collective(
        self,
        what: str,
        start: Callable[[_Gloo], list[Work]],
        buffers: list[torch.Tensor],
    ) -> StepAborted | None:
        """Run the works ``start`` issues; None once all succeeded. Otherwise
        the group is released (or parked while a work still runs) and the
        reason returned."""
        started = time.monotonic()
        works = self._start(what, start)
        if isinstance(works, StepAborted):
            return works
        return self._wait(what, works, buffers, started)

    def _wait(
        self, what: str, works: list[Work], buffers: list[torch.Tensor], started: float
    ) -> StepAborted | None:
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
                        if self._abort.is_set():
                            # Most likely the abort's own doing, passed on by
                            # a peer that aborted first: the view is being
                            # changed already, no peer is to be blamed.
                            return StepAborted(f"epoch {self.epoch}: {what} aborted ({failure})")
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
        leak(f"epoch {self.epoch} group", pg, store, *pending, *buffers)

    def _release(self, works: list[Work], buffers: list[torch.Tensor]) -> None:
        """Destroy the group now if none of ``works`` still runs (which also
        tells peers blocked on it, by resetting their connections); otherwise
        park it with them until they end."""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        _open_groups.discard(self)
        pending = [work for work in works if not work.is_completed()]
        if pending and pg is not None:
            park(
                f"epoch {self.epoch} group",
                lambda: all(work.is_completed() for work in pending),
                self.hard_timeout,
                self._config,
                pg,
                store,
                pending,
                list(buffers),
            )


class Pending:
    """Collectives started and not waited for yet (:meth:`EpochGroup.finish`)."""

    def __init__(self, works: list[Work], buffers: list[torch.Tensor], started: float) -> None:
        self.works, self.buffers, self.started = works, buffers, started


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
