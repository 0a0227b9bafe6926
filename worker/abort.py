"""What every abandonable wait of the gloo group shares: the abort flag it
polls, the patience that bounds it, and the two ways it ends early.

A wait here is abandoned when ``abort`` is set (a roll call, a failed peer)
or when a peer fails or stays away past ``patience``; either way nothing
of the step is applied (``StepAborted``, ``PeerFailed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rollcall.membership.errors import RollcallError

__all__ = ["AbortFlag", "Patience", "PeerFailed", "StepAborted", "patient"]


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


def patient(timeout: float) -> Patience:
    """Patience of a wait that may last ``timeout`` seconds, whatever happens."""
    return lambda started: started + timeout
