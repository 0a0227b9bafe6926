"""The buffer a fetched state lands in: fresh memory whose pages are put in
place ahead of the bytes, while the bytes already arrive.

On the 2-core VMs measured here a page's first touch costs more than moving
its bytes over loopback TCP. Receiving into pages the kernel faults in one
by one inside ``recv`` made a fetch twice as slow; populating the whole
buffer first (``MAP_POPULATE``, cheaper than zeroing a ``bytearray``) put a
third of a 78 MB fetch in front of its first byte. So the pages are touched
in chunks, in order, by a thread of their own, while the streams receive
behind it; a stream that catches up touches the chunks it needs itself
rather than wait for that thread (which, on a busy machine, gets its turn
no sooner than any other).

The buffer asks for transparent huge pages (``MADV_HUGEPAGE``; the kernels
here have them in ``madvise`` mode): one fault then puts 2 MiB in place
instead of 4 KiB, and touching 512 MB went from 1.5 to 9.5 GB/s on this
machine (`bench/README.md`, "State transfer into huge pages"). Where the kernel has
none, or does not honour the advice, the pages are ordinary ones.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import threading

import numpy as np

__all__ = ["CHUNK_BYTES", "Landing", "advise_huge_pages"]

#: Bytes touched at a time: small enough that the first bytes land early,
#: large enough that handing a chunk over costs nothing next to its pages.
CHUNK_BYTES = 4 << 20

_FREE, _TOUCHING, _READY = 0, 1, 2


def advise_huge_pages(buffer: mmap.mmap) -> None:
    """Ask the kernel to back ``buffer`` (not touched yet) with transparent
    huge pages; a kernel without them, or that refuses, changes nothing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            buffer.madvise(advice)


class Landing:
    """A zeroed, writable buffer of ``size`` (> 0) bytes (``buffer``) whose
    pages a thread of its own touches in order; ``claim(start, end)``
    returns once bytes [start, end) are in place, touching those nobody
    has started on itself. Nothing touches a chunk once it is in place."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"a landing holds bytes, not {size}")
        self.size = size
        # Private: shared anonymous memory is shmem, whose huge pages are off.
        self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise_huge_pages(self.buffer)
        self._pages = np.frombuffer(self.buffer, dtype=np.uint8)
        self._chunks = [_FREE] * (-(-size // CHUNK_BYTES))
        self._changed = threading.Condition()
        self._left = len(self._chunks)
        threading.Thread(target=self._touch_all, name="rollcall-landing", daemon=True).start()

    def claim(self, start: int, end: int, timeout: float) -> bool:
        """Whether bytes [start, end) are in place within ``timeout``."""
        for chunk in range(start // CHUNK_BYTES, -(-end // CHUNK_BYTES)):
            if self._take(chunk):
                continue
            with self._changed:
                if not self._changed.wait_for(functools.partial(self._ready, chunk), timeout):
                    return False
        return True

    def _ready(self, chunk: int) -> bool:
        return self._chunks[chunk] == _READY

    def _touch_all(self) -> None:
        for chunk in range(len(self._chunks)):
            self._take(chunk)
        with self._changed:
            self._changed.wait_for(lambda: self._left == 0)
            del self._pages  # the buffer's export, which would keep it from being unmapped

    def _take(self, chunk: int) -> bool:
        """Touch ``chunk`` if nobody has started on it; whether it is in
        place when this returns (False: another thread is touching it)."""
        with self._changed:
            if self._chunks[chunk] != _FREE:
                return self._chunks[chunk] == _READY
            self._chunks[chunk] = _TOUCHING
        start = chunk * CHUNK_BYTES
        end = min(start + CHUNK_BYTES, self.size)
        self._pages[start : end : mmap.PAGESIZE] = 0  # one write per page: the fault is the point
        with self._changed:
            self._chunks[chunk] = _READY
            self._left -= 1
            self._changed.notify_all()
        return True
