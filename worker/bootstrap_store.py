"""Hosting a view's bootstrap store and meeting the other ranks there.

The view's rank 0 hosts a ``TCPStore`` (:func:`host_store`); every rank
connects to it and waits there until all have arrived (:func:`meet`)
before gloo is asked to build the group, because gloo itself would wait for
an absent peer until its timeout, unabortably. Every key goes through the
epoch's sealed store (``rollcall.worker.bootstrap``).
"""

from __future__ import annotations

import datetime
import socket
import time

from torch.distributed import TCPStore

from rollcall.membership.config import Config
from rollcall.worker.abort import AbortFlag, Patience, PeerFailed, StepAborted
from rollcall.worker.bootstrap import epoch_store

__all__ = ["LOOPBACK", "forget_hosted", "host_store", "meet", "take_hosted"]

#: Default address the gloo transport and a hosted store bind to.
LOOPBACK = "127.0.0.1"

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


def take_hosted(port: int) -> TCPStore | None:
    """The store this process hosts on ``port``, handed over to its group
    (None if it hosts none there)."""
    return _hosted.pop(port, None)


def forget_hosted() -> None:
    """Drop the stores hosted but never handed to a group (at exit)."""
    _hosted.clear()


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


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


def meet(
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
    listener: tuple[str, int] | None = None,
) -> tuple[TCPStore, set[tuple[str, int]]]:
    """Connect to the epoch's store (unless this rank hosts it) and wait there
    until every rank has arrived: gloo itself would wait for an absent peer
    until its timeout, unabortably. Each rank arrives with its gloo
    listener (``listener``, None if it was not found), and the store and
    the listeners of all ranks are returned: what tells the group's own
    connections from the process's others once gloo has made them. Runs on
    a helper thread, because a store request to a host that died blocks
    while the client reconnects."""
    started = time.monotonic()
    if hosted is None:
        _await_listener(epoch, store_host, store_port, started, patience, abort, config)
    store = hosted or TCPStore(
        store_host, store_port, None, False, _delta(timeout), wait_for_workers=False
    )
    scoped = epoch_store(epoch, store, secret)
    arrival = "" if listener is None else f"{listener[0]}:{listener[1]}"
    scoped.set(f"rollcall/joined/{rank}", arrival)
    keys = [f"rollcall/joined/{peer}" for peer in range(size)]
    # Ranks arrive within milliseconds of each other and the whole view
    # change waits for the last look: a short pause, not the abort poll.
    while not scoped.check(keys):
        if abort.is_set():
            raise StepAborted(f"epoch {epoch}: aborted while waiting for peers")
        if time.monotonic() >= patience(started):
            missing = [peer for peer in range(size) if not scoped.check([keys[peer]])]
            reason = f"ranks {missing} did not join"
            raise PeerFailed(f"epoch {epoch}: {reason}", reason)
        time.sleep(config.group_meet_poll)
    listeners = set()
    for value in scoped.multi_get(keys):
        host, _, port = value.decode().rpartition(":")
        if host:
            listeners.add((host, int(port)))
    return store, listeners
