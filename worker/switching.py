"""Python's thread switch interval, shortened while the view changes.

The training thread holds the GIL for most of a microbatch (a small model's
forward pass is one short torch call after another), and a thread that
wants the GIL waits up to the switch interval (5 ms by default) each time
it asks, after every socket call or sleep. During a view change the
threads that decide how long it takes are the others: the roll-call
answer's digest, the session, the group's build, which run while the
training thread finishes the microbatch it is in or, once the view is in
place, takes over a dead rank's share. So the interval is shortened from a
roll call's arrival until the first step of the next view commits, and put
back as it was then (measured on 2 cores, 4 workers: the answer's digest
13 ms instead of 17 ms, wall; the rebuild overlapped with the first
microbatch instead of slowed by it).
"""

from __future__ import annotations

import sys
import threading

__all__ = ["SwitchInterval"]


class SwitchInterval:
    """Shortens the interpreter's switch interval to ``short`` seconds (never
    lengthens it) for a view change, and restores the value found then.
    Safe to call from any thread, any number of times."""

    def __init__(self, short: float) -> None:
        self._short = short
        self._lock = threading.Lock()
        #: The interval found when it was shortened (None: not shortened),
        #: whether it was changed, and the newest roll call's epoch since:
        #: the view change that restoring waits for.
        self._saved: float | None = None
        self._changed = False
        self._epoch = 0

    def shorten(self, epoch: int) -> None:
        """Roll call ``epoch`` arrived."""
        with self._lock:
            self._epoch = max(self._epoch, epoch)
            if self._saved is not None:
                return
            self._saved = sys.getswitchinterval()
            self._changed = self._short < self._saved
            if self._changed:
                sys.setswitchinterval(self._short)

    def committed(self, epoch: int) -> None:
        """A step committed in view ``epoch``: restore if that view is the
        newest roll call's or later (a step of the view being left that
        lands while its roll call waits for it does not end the change)."""
        with self._lock:
            if self._saved is not None and epoch >= self._epoch:
                self._restore()

    def restore(self) -> None:
        """Restore now, whatever the view (the worker leaves)."""
        with self._lock:
            if self._saved is not None:
                self._restore()

    def _restore(self) -> None:
        assert self._saved is not None
        if self._changed:  # (a value read back and set again may drift by 1 us)
            sys.setswitchinterval(self._saved)
        self._saved = None
