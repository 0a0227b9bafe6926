"""The runtime's life cycle, told to the process that supervises it.

A supervisor (``rollcall up``) that starts training processes it did not
write cannot learn their member id, state and step from their output, which
is the user's. So it hands each one end of a Unix socket pair of type
``SOCK_SEQPACKET`` and names the file descriptor in ``$ROLLCALL_REPORT_FD``;
the runtime then sends one JSON object, ending in a newline, per event:

- ``joined``: ``member_id``, ``pid``, ``address`` (the state server's);
- ``step``: ``step``, ``epoch``, ``rank``, ``world``, ``loss``, ``samples_s``
  (samples committed per second since the previous step event; null in the
  first), for the first committed step of each view and then at most every
  ``STEP_INTERVAL``;
- ``resumed``: the replay cost of a resume from a durable checkpoint
  (``rollcall.membership.checkpoint.ReplayCost.to_dict``);
- ``done``: ``step``, the last committed step, when ``steps()`` ran out;
- ``ended``: ``why`` (an ``EndReason``) and ``message``, when the runtime is
  closed.

Why a sequenced-packet socket rather than a pipe: each send is one whole
message or nothing, so a nearly full buffer never tears a line, and
``send(MSG_NOSIGNAL)`` cannot raise SIGPIPE, which would kill the training
process of a program that restored SIGPIPE's default action once the
supervisor is gone.

Reporting never holds training up: sends do not block; a step event that
finds the buffer full is dropped (the next one says more), while ``joined``,
``resumed``, ``done`` and ``ended`` (a handful per process) wait, in order,
to go out with the next send; ``ended``, the last, waits at most
``FLUSH_TIMEOUT`` for room. A supervisor that went away disables the channel
(logged once, at DEBUG). Without ``$ROLLCALL_REPORT_FD`` every call returns
at once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol

from rollcall.membership.checkpoint import ReplayCost
from rollcall.membership.errors import CannotResume, Evicted, Interrupted
from rollcall.worker.environment import ENV_REPORT_FD

log = logging.getLogger("rollcall.report")

#: Least time between two step events of one view.
STEP_INTERVAL = 0.2
#: How long ``ended`` waits for room when the supervisor is slow to read.
FLUSH_TIMEOUT = 1.0
#: An error message is cut to this many characters (an event stays small).
MESSAGE_LIMIT = 1000


class Event(StrEnum):
    """The ``event`` field of a report."""

    JOINED = "joined"
    STEP = "step"
    RESUMED = "resumed"
    DONE = "done"
    ENDED = "ended"


class EndReason(StrEnum):
    """Why the runtime ended (the ``why`` of ``ended``)."""

    #: Closed normally (after ``done``, or the loop stopped early on purpose).
    LEFT = "left"
    #: The control plane removed this member; its state is stale.
    EVICTED = "evicted"
    #: SIGINT or SIGTERM (``Interrupted``), or a KeyboardInterrupt.
    INTERRUPTED = "interrupted"
    #: No live worker holds the job's state and it cannot be restored
    #: (``CannotResume``: no usable checkpoint, or progress but none).
    CANNOT_RESUME = "cannot resume"
    #: Any other exception (a ``SystemExit`` with a non-zero code included).
    ERROR = "error"


class CommittedStep(Protocol):
    """What a step event reads of ``rollcall.worker.runtime.Step``."""

    number: int
    epoch: int
    rank: int
    world_size: int
    loss: float | None


def end_reason(error: BaseException | None) -> EndReason:
    """Which ``EndReason`` an exception in flight at close means."""
    if error is None:
        return EndReason.LEFT
    if isinstance(error, Evicted):
        return EndReason.EVICTED
    if isinstance(error, CannotResume):
        return EndReason.CANNOT_RESUME
    if isinstance(error, Interrupted | KeyboardInterrupt):
        return EndReason.INTERRUPTED
    if isinstance(error, SystemExit) and error.code in (None, 0):
        return EndReason.LEFT
    return EndReason.ERROR


def describe(error: BaseException | None) -> str:
    """The ``message`` of ``ended``: the exception's type and text, cut."""
    if error is None:
        return ""
    text = str(error)
    message = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return message[:MESSAGE_LIMIT]


class SupervisorReport:
    """The sending end of the report channel (a no-op without a socket)."""

    def __init__(
        self,
        sock: socket.socket | None,
        *,
        step_interval: float = STEP_INTERVAL,
        flush_timeout: float = FLUSH_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = sock
        if sock is not None:
            sock.setblocking(False)
        self._step_interval = step_interval
        self._flush_timeout = flush_timeout
        self._clock = clock
        self._lock = threading.Lock()  # joined comes from the control thread
        self._pending: deque[bytes] = deque()
        self._ended = False
        # The training thread's alone: epoch and time of the last step event,
        # and (start, samples) of the window its rate is measured over.
        self._step_epoch: int | None = None
        self._step_sent = 0.0
        self._window: tuple[float | None, int] = (None, 0)

    @classmethod
    def from_env(cls) -> SupervisorReport:
        """The channel named by ``$ROLLCALL_REPORT_FD``, if any. The variable
        is removed, and the descriptor is not inherited: the channel belongs
        to this process, not to programs it starts."""
        value = os.environ.pop(ENV_REPORT_FD, "")
        if not value:
            return cls(None)
        try:
            fd = int(value)
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError) as exc:
            log.warning("%s=%r is not a socket (%s): not reporting", ENV_REPORT_FD, value, exc)
            return cls(None)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.detach()  # not ours to close
            log.warning("%s=%s is not a Unix SOCK_SEQPACKET socket: not reporting",
                        ENV_REPORT_FD, fd)  # fmt: skip
            return cls(None)
        sock.set_inheritable(False)
        return cls(sock)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def fileno(self) -> int | None:
        """The channel's descriptor (None without one): a forked child that
        must not keep the channel open closes it."""
        return self._sock.fileno() if self._sock is not None else None

    # --- events ---------------------------------------------------------------------

    def joined(self, member_id: str, address: str) -> None:
        self._send({"event": Event.JOINED, "member_id": member_id, "pid": os.getpid(),
                    "address": address}, keep=True)  # fmt: skip

    def step(self, step: CommittedStep, samples: int) -> None:
        """A committed step of ``samples`` samples (the global batch)."""
        if self._sock is None:
            return
        now = self._clock()
        start, counted = self._window
        counted += samples
        if step.epoch == self._step_epoch and now - self._step_sent < self._step_interval:
            self._window = (start, counted)
            return
        rate = counted / (now - start) if start is not None and now > start else None
        self._window = (now, 0)
        self._step_epoch, self._step_sent = step.epoch, now
        self._send({"event": Event.STEP, "step": step.number, "epoch": step.epoch,
                    "rank": step.rank, "world": step.world_size, "loss": step.loss,
                    "samples_s": rate}, keep=False)  # fmt: skip

    def resumed(self, cost: ReplayCost) -> None:
        self._send({"event": Event.RESUMED, **cost.to_dict()}, keep=True)

    def done(self, step: int) -> None:
        self._send({"event": Event.DONE, "step": step}, keep=True)

    def ended(self, error: BaseException | None) -> None:
        """The last event (later calls do nothing): why the runtime ended,
        from the exception in flight (None: a normal close). Waits at most
        ``flush_timeout`` for every kept event to go out, then closes."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        record = {"event": Event.ENDED, "why": end_reason(error), "message": describe(error)}
        self._send(record, keep=True)
        deadline = time.monotonic() + self._flush_timeout
        while True:
            with self._lock:
                self._drain()
                sock = self._sock
                if sock is None or not self._pending:
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.debug("supervisor not reading: %d reports not sent", len(self._pending))
                break
            select.select([], [sock], [], remaining)
        with self._lock:
            self._close()

    # --- sending --------------------------------------------------------------------

    def _send(self, record: dict[str, Any], keep: bool) -> None:
        data = (json.dumps(record) + "\n").encode()
        with self._lock:
            self._drain()
            if self._sock is None:
                return
            if self._pending or not self._write(data):
                # No room (or older events still wait): only events the
                # supervisor must see wait, after the older ones.
                if keep and self._sock is not None:
                    self._pending.append(data)

    def _drain(self) -> None:
        while self._pending and self._write(self._pending[0]):
            self._pending.popleft()

    def _write(self, data: bytes) -> bool:
        """Send one message; False if there is no room now (or the channel
        just broke: it is then disabled)."""
        if self._sock is None:
            return False
        try:
            self._sock.send(data, socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return False
        except OSError as exc:  # EPIPE, ECONNRESET...: the supervisor is gone
            log.debug("supervisor report channel closed (%s): reporting stops", exc)
            self._close()
            return False
        return True

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pending.clear()
