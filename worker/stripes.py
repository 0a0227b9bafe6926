"""Chunks and stripes of a blob (a replica state's bytes): the pieces a
transfer streams, the ranges it fetches from several peers at once, and
their reassembly in bounded memory.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

__all__ = ["Assembler", "chunks", "ranges"]


def chunks(data: bytes, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, piece) pieces of at most `chunk_size` bytes, in order,
    covering `data` exactly (nothing for empty data)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for offset in range(0, len(data), chunk_size):
        yield offset, data[offset : offset + chunk_size]


def ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, total) into at most `parts` contiguous (offset, length)
    ranges whose lengths differ by at most one, longer ones first; used to
    stripe a fetch across peers. Empty ranges are dropped, so `parts > total`
    yields `total` ranges of one byte."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, longer = divmod(total, parts)
    result = []
    offset = 0
    for index in range(min(parts, total)):
        length = base + 1 if index < longer else base
        result.append((offset, length))
        offset += length
    return result


class Assembler:
    """Reassembles a blob of `total` bytes from pieces fetched from different
    peers, in any order. Memory is bounded by `total`: a piece that falls
    outside the blob or overlaps one already received is refused."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self._buffer = bytearray(total)
        # Received [start, end) intervals, sorted, disjoint and never adjacent
        # (adjacent ones are merged), so in-order arrival keeps one interval.
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, offset: int, piece: bytes) -> None:
        """Store `piece` at `offset`. ValueError if it does not fit in the blob
        or overlaps bytes already received."""
        end = offset + len(piece)
        if offset < 0 or end > self.total:
            raise ValueError(f"piece [{offset}, {end}) lies outside the blob of {self.total} bytes")
        if not piece:
            return
        index = bisect.bisect_right(self._starts, offset)
        if index > 0 and self._ends[index - 1] > offset:
            raise ValueError(
                f"piece [{offset}, {end}) overlaps received "
                f"[{self._starts[index - 1]}, {self._ends[index - 1]})"
            )
        if index < len(self._starts) and self._starts[index] < end:
            raise ValueError(
                f"piece [{offset}, {end}) overlaps received "
                f"[{self._starts[index]}, {self._ends[index]})"
            )
        self._buffer[offset:end] = piece
        start = offset
        if index > 0 and self._ends[index - 1] == offset:
            index -= 1
            start = self._starts[index]
            del self._starts[index], self._ends[index]
        if index < len(self._starts) and self._starts[index] == end:
            end = self._ends[index]
            del self._starts[index], self._ends[index]
        self._starts.insert(index, start)
        self._ends.insert(index, end)

    def missing(self) -> list[tuple[int, int]]:
        """The (offset, length) ranges not received yet, in order."""
        gaps = []
        position = 0
        for start, end in zip(self._starts, self._ends, strict=True):
            if start > position:
                gaps.append((position, start - position))
            position = end
        if position < self.total:
            gaps.append((position, self.total - position))
        return gaps

    def complete(self) -> bool:
        """Whether every byte has been received."""
        return self.total == 0 or (self._starts == [0] and self._ends == [self.total])

    def result(self) -> bytearray:
        """The reassembled blob: the assembler's own buffer, not a copy (a
        copy of a large state costs as much as its decode and digest check
        together). ValueError while bytes are missing; once complete, no
        piece can change it."""
        if not self.complete():
            raise ValueError(f"blob incomplete, missing (offset, length) {self.missing()}")
        return self._buffer
