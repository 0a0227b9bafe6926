"""The state a worker serves to its peers, serialized the first time one
asks for it.

A roll-call answer names the step and the digest of the state the worker
will serve; the state is captured then, but its byte form is made only
when a peer first asks for it (``Describe``, a data-channel request). In a
crash nobody fetches, and serializing (2.5 ms for the example's 1.7 MB,
more on a busy machine) was part of every survivor's answer, on the path
of every view change.

A capture may share the parameters and optimizer state with the live
objects instead of cloning them (``capture(..., live=True)``: cloning 306
MB took 0.6-0.9 s on 2 cores, on the answer's path). Such a capture is
served only until the next update or restore, which calls
``release_live`` first: the capture is then dropped, unless it was
serialized (the byte form is a copy). Serializing holds this object's
lock, so an update never changes tensors while they are being copied.
Every fetcher of a view is served before the view's first update: it
takes part in that update's reduction only once its fetch has landed.
"""

from __future__ import annotations

import threading

from rollcall.worker.state import ReplicaState
from rollcall.worker.state_bytes import to_bytes
from rollcall.worker.transfer import Snapshot

__all__ = ["ServedState"]


class ServedState:
    """What this worker serves: a snapshot, or a captured state whose
    snapshot is made on first use. Safe to use from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        #: (step, digest, state, whether it shares tensors with the live objects)
        self._captured: tuple[int, str, ReplicaState, bool] | None = None

    def held(self) -> tuple[int, str] | None:
        """(step, digest) of the state served, serialized yet or not; None
        if none is."""
        with self._lock:
            if self._captured is not None:
                return self._captured[0], self._captured[1]
            if self._snapshot is not None:
                return self._snapshot.step, self._snapshot.digest
            return None

    def serve_captured(
        self, step: int, digest: str, state: ReplicaState, live: bool = False
    ) -> None:
        """Serve ``state`` (captured after ``step``, whose digest is
        ``digest``) from now on. ``live``: it shares tensors with the live
        objects, and ``release_live`` must be called before they change;
        otherwise it never changes."""
        with self._lock:
            self._captured = (step, digest, state, live)
            self._snapshot = None

    def release_live(self) -> None:
        """(Before the live objects change: an update, a restore.) Drop a
        capture that shares their tensors and was not serialized yet;
        waits for a serialization in progress. Nothing for anything else."""
        with self._lock:
            if self._captured is not None and self._captured[3]:
                self._captured = None

    def serve(self, snapshot: Snapshot | None) -> None:
        """Serve ``snapshot`` (a state already in byte form) from now on, or
        nothing."""
        with self._lock:
            self._captured = None
            self._snapshot = snapshot

    def snapshot(self) -> Snapshot | None:
        """The snapshot served, serialized now if it was only captured (once:
        every later caller gets the same bytes)."""
        with self._lock:
            if self._captured is not None:
                step, digest, state, _ = self._captured
                self._snapshot = Snapshot(step, digest, to_bytes(state))
                self._captured = None
            return self._snapshot
