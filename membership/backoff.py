"""Exponential back-off as a pure sequence of delays.

A retry loop (the client's replica failover, session and watch, the etcd
client's watches, the state fetcher's calls, the service's campaign and view
commits) waits the same way: ``initial`` first, doubling after each wait,
never more than ``maximum``, and from ``initial`` again once an attempt got
somewhere. This holds the arithmetic; the caller sleeps (``asyncio.sleep``,
``Event.wait``), so the sequence needs no clock and tests need no sleep.
"""

from __future__ import annotations

import math


class Backoff:
    """The delays of one retry loop: ``initial``, doubling, capped at
    ``maximum``; :meth:`reset` starts again from ``initial``."""

    def __init__(self, initial: float, maximum: float) -> None:
        if not 0 < initial <= maximum or math.isinf(maximum):
            raise ValueError(
                f"a back-off needs 0 < initial <= maximum < inf, got {initial!r} and {maximum!r}"
            )
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def next(self) -> float:
        """The delay to wait now; the one after it is twice as long, up to
        ``maximum``."""
        delay = self._next
        self._next = min(delay * 2, self.maximum)
        return delay

    def reset(self) -> None:
        """An attempt succeeded: the next delay is ``initial`` again."""
        self._next = self.initial
