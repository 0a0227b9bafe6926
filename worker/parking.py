"""Parking: whatever gloo may still be running is kept alive until it stops.

An operation of the group that was abandoned (a build still connecting, a
collective whose connections could not all be shut down) cannot be
stopped, and destroying what it uses while it runs blocks or aborts the
process. So it is *parked*: its objects stay referenced until it finishes,
at the latest when its own timeout fires (plus ``Config.group_park_grace``),
and only then released. One that cannot be stopped at all is *leaked*: kept
until the process exits.

The registry is process-global: a process that parked anything must call
:func:`wait_parked` before it exits (``rollcall.worker.group`` does it in an
``atexit`` hook too).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollcall.membership.config import Config

__all__ = ["leak", "leaked_count", "park", "parked_count", "sweep", "wait_at_exit", "wait_parked"]

log = logging.getLogger("rollcall.group")


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


def park(
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


def leak(what: str, *keep: object) -> None:
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


def sweep() -> None:
    """Release what finished, if anything is parked (costs nothing otherwise)."""
    if _parked:
        _release_finished()


def wait_at_exit() -> None:
    """Wait for what is parked, saying what and for how long, while the
    interpreter is still intact."""
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
