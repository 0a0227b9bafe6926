"""A blocking call on a thread of its own, which its caller can stop waiting
for: the thread-per-call helper of the gloo group.

Failures are returned as StepAborted values, never raised here: the group
raises them only from frames that hold no gloo object. An exception's
traceback keeps its frames' locals alive, and a group or work kept alive
that way keeps its sockets open (peers then wait for the timeout instead of
seeing a reset) and outlives interpreter shutdown (SIGABRT).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from rollcall.membership.config import Config
from rollcall.worker.abort import AbortFlag, PeerFailed, StepAborted
from rollcall.worker.parking import park

__all__ = ["BackgroundCall"]

T = TypeVar("T")


class BackgroundCall(Generic[T]):
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
                park(self.what, self._done.is_set, timeout, config)
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
