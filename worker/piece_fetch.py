"""One state fetch over the data channel (``rollcall.worker.data_channel``):
striped across every source, checked piece by piece as the bytes arrive,
repaired piece by piece.

1. The header (the state's structure and tensor table) comes from the
   first source that delivers one that decodes; the tensors are views into
   the fetch's buffer from then on.
2. ``transfer_streams`` connections, spread over the sources, each take the
   next unit (whole pieces, ``transfer_unit_bytes``) and receive it
   straight into the buffer, hashing each piece as soon as it is in
   (hashlib releases the GIL, so hashing overlaps receiving). A connection
   that fails puts its unit back for the others and moves to the next
   source still standing.
3. The pieces' digests and the structure give the state's digest
   (``digest_of_pieces``): no pass over the bytes at the end. Equal to the
   agreed digest: done.
4. Otherwise a source's own header and list of piece digests is taken as
   the reference once they give the agreed digest (so a forged list cannot
   pass); every piece that differs from it is fetched again from another
   source and checked against it at once.

Never loaded: a state whose digest is not the agreed one, or one carrying
RNG states (the digest does not cover them, and served states never carry
them).
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError
from rollcall.worker.data_channel import DataConnection, SourceFailed
from rollcall.worker.data_wire import Hello, Kind, Request
from rollcall.worker.digest import digest_of_pieces, piece_hash
from rollcall.worker.landing import Landing
from rollcall.worker.pieces import HASH_BYTES, Piece, Unit, by_tensor, pieces_of, units_of
from rollcall.worker.state import CorruptState, ReplicaState
from rollcall.worker.state_bytes import PREFIX_BYTES, Decoded, decode, layout_of, validated

__all__ = ["DataSource", "PieceFetch", "PieceFetchFailed"]

log = logging.getLogger("rollcall.transfer")

#: A stream receives at least this much before it hashes what came in
#: (whole pieces: many small tensors in one receive, a large one piece by
#: piece, each hashed while it is still in the cache).
_MIN_READ = 1 << 18


class PieceFetchFailed(RollcallError):
    """No source could deliver the state with the agreed digest."""


@dataclass(frozen=True)
class DataSource:
    """A holder of the agreed state, as its ``Describe`` answered."""

    #: Its state server's address (its name in logs and reports).
    address: str
    host: str
    port: int
    header_size: int


@dataclass
class PieceFetchReport:
    """What the fetch did beyond the plain path."""

    #: Sources that failed (unreachable, broke off, refused, or delivered
    #: pieces or a header the agreed digest refuted), with why.
    failed: dict[str, str]
    #: Pieces fetched again after they failed the reference list.
    refetched_pieces: int


class PieceFetch:
    """Fetch the state of ``size`` bytes with digest ``expected`` from
    ``sources`` into a fresh buffer (``run``), admitted as ``hello``'s member
    of its epoch with ``secret``, within ``deadline`` (``time.monotonic``).
    ``cancel`` ends it early (``PieceFetchFailed``)."""

    def __init__(
        self, sources: Sequence[DataSource], size: int, expected: str, hello: Hello,
        secret: str, config: Config, deadline: float,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:  # fmt: skip
        if size <= 0:
            raise ValueError(f"a state has bytes, not {size}")
        self._sources = list(sources)
        self._size = size
        self._expected = expected
        self._hello = hello
        self._secret = secret
        self._config = config
        self._deadline = deadline
        self._progress = progress
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._open: set[DataConnection] = set()
        self._failed: dict[str, str] = {}
        self._done = 0
        #: The fetch's buffer, once allocated (``run`` returns with it).
        self.buffer: mmap.mmap | None = None
        self._landing: Landing | None = None
        self._view = memoryview(b"")
        #: Set once the buffer holds a header and the units are queued, or
        #: once the fetch gave up (``_queue`` then stays empty).
        self._ready = threading.Event()
        self._decoded: Decoded | None = None
        #: The source of the header in the buffer.
        self._header_source = ""
        self._pieces: tuple[Piece, ...] = ()
        #: Units not taken yet: each stream's first, then the others in order.
        self._first: dict[int, Unit] = {}
        self._queue: collections.deque[Unit] = collections.deque()
        #: (start, end) of each piece received -> (its digest, the source).
        self._hashes: dict[tuple[int, int], tuple[bytes, str]] = {}

    def cancel(self) -> None:
        """End the fetch now (from any thread): ``run`` raises."""
        self._cancel.set()
        self._abort_all()

    def run(self) -> tuple[ReplicaState, PieceFetchReport]:
        """The verified state, whose tensors are views into ``buffer``. The
        buffer is allocated, the header fetched and the streams connected
        at the same time."""
        allocating = threading.Thread(target=self._allocate, name="rollcall-fetch-alloc")
        allocating.start()
        streams = self._start_streams()
        try:
            head, pieces = self._take_header()
            allocating.join()
            if self.buffer is None:
                raise PieceFetchFailed(f"no memory for a state of {self._size} bytes")
            self._landed(0, len(head))
            self._install(head, pieces, len(streams))
            self._ready.set()
            self._decode()
            self._join(streams)
            self._landed(0, self._size)  # nothing writes into the buffer behind the fetch's back
            state = self._assembled()
            refetched = 0
            if state is None:
                state, refetched = self._repair()
            if self._progress is not None:
                self._progress(self._size, self._size)
            return state, PieceFetchReport(dict(self._failed), refetched)
        finally:
            self._ready.set()  # a stream still waiting finds nothing queued and ends
            self._abort_all()
            allocating.join()

    def _allocate(self) -> None:
        try:
            self._landing = Landing(self._size)
        except (MemoryError, OSError) as exc:
            log.warning("no memory for a state of %d bytes: %s", self._size, exc)
            return
        self.buffer = self._landing.buffer
        self._view = memoryview(self.buffer)

    def _landed(self, start: int, end: int) -> None:
        """Once the buffer's bytes [start, end) are in place."""
        assert self._landing is not None
        if not self._landing.claim(start, end, max(0.0, self._remaining())):
            raise PieceFetchFailed(f"state fetch of {self._expected} ran out of time")

    # --- connections ------------------------------------------------------------------

    def _connect(self, source: DataSource) -> DataConnection:
        self._check_time()
        conn = DataConnection.open(
            source.address, source.host, source.port, self._hello, self._secret, self._config,
            timeout=max(0.001, min(self._config.transfer_stall_timeout, self._remaining())),
        )  # fmt: skip
        with self._lock:
            self._open.add(conn)
        if self._cancel.is_set():
            conn.abort()
        return conn

    def _release(self, conn: DataConnection) -> None:
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def _abort_all(self) -> None:
        with self._lock:
            for conn in self._open:
                conn.abort()

    def _remaining(self) -> float:
        return self._deadline - time.monotonic()

    def _check_time(self) -> None:
        if self._cancel.is_set():
            raise PieceFetchFailed("state fetch cancelled")
        if self._remaining() <= 0:
            raise PieceFetchFailed(f"state fetch of {self._expected} ran out of time")

    def _fail(self, address: str, why: object) -> None:
        with self._lock:
            self._failed.setdefault(address, str(why))

    # --- the plain path ---------------------------------------------------------------

    def _take_header(self) -> tuple[bytearray, tuple[Piece, ...]]:
        """The header from the first source whose header decodes, and the
        pieces it lays out."""
        for source in self._sources:
            try:
                return self._header_of(source)
            except SourceFailed as exc:
                log.warning("state header from %s unavailable: %s", source.address, exc)
                self._fail(source.address, exc)
            except CorruptState as exc:
                log.warning(
                    "corrupt state from %s: its header does not lay out this state (%s); "
                    "taking the header from another source", source.address, exc,
                )  # fmt: skip
                self._fail(source.address, exc)
        raise PieceFetchFailed(
            f"no source delivered the header of state {self._expected}: {self._failed}"
        )

    def _header_of(self, source: DataSource) -> tuple[bytearray, tuple[Piece, ...]]:
        """``source``'s header, if it lays out a blob of this size."""
        size = source.header_size
        if not PREFIX_BYTES <= size <= self._size:
            raise CorruptState(f"header of {size} bytes in a state of {self._size}")
        conn = self._connect(source)
        try:
            head = bytearray(size)
            conn.ask(Request(Kind.RANGE, self._expected, 0, size), size, exact=True)
            conn.read_into(memoryview(head))
        finally:
            self._release(conn)
        data_start, spans = layout_of(head, self._size)
        if data_start != size:
            raise CorruptState(f"header says tensor bytes start at {data_start}, not {size}")
        self._header_source = source.address
        return head, pieces_of(spans, data_start)

    def _install(self, head: bytearray, pieces: tuple[Piece, ...], streams: int = 1) -> None:
        """Put ``head`` at the start of the buffer and queue units for the
        pieces: ``transfer_unit_bytes`` each, smaller for a small state so
        that each of the ``streams`` gets one."""
        self._view[: len(head)] = head
        self._pieces = pieces
        share = -(-(self._size - len(head)) // max(1, streams))
        units = units_of(pieces, max(1, min(self._config.transfer_unit_bytes, share)))
        with self._lock:
            self._first = dict(enumerate(units[:streams]))
            self._queue = collections.deque(units[streams:])

    def _decode(self) -> None:
        """The tree over the buffer (its tensors are views, valid before
        their bytes are in); None if the header does not decode."""
        assert self.buffer is not None
        try:
            self._decoded = decode(self.buffer)
        except CorruptState as exc:
            log.warning("corrupt state from %s: its header does not decode: %s",
                        self._header_source, exc)  # fmt: skip
            self._decoded = None

    def _start_streams(self) -> list[threading.Thread]:
        """``transfer_streams`` connections (at least one per source, at
        most one per unit the state's size makes), each taking units once
        they are queued."""
        count = max(self._config.transfer_streams, len(self._sources))
        threads = [
            threading.Thread(
                target=self._stream, args=(i, self._sources[i % len(self._sources)]),
                name="rollcall-fetch-stream", daemon=True,
            )
            for i in range(count)
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        return threads

    def _join(self, streams: Sequence[threading.Thread]) -> None:
        # Each stream ends by the deadline plus a stalled call or two.
        end = self._deadline + 2 * self._config.transfer_stall_timeout
        for thread in streams:
            thread.join(max(0.0, end - time.monotonic()))
        self._check_time()
        left = len(self._queue) + len(self._first)
        if left or any(t.is_alive() for t in streams):
            raise PieceFetchFailed(
                f"state {self._expected}: {left} units left that no source delivered: "
                f"{self._failed}"
            )

    def _stream(self, index: int, source: DataSource) -> None:
        """(A stream's thread.) Connect, wait for the units, take them until
        none are left, moving to the next source still standing when this
        one fails."""
        conn: DataConnection | None = None
        try:
            try:
                conn = self._connect(source)
            except SourceFailed as exc:
                self._fail(source.address, exc)
            except PieceFetchFailed:
                return
            if not self._ready.wait(max(0.0, self._remaining())):
                return
            while True:
                with self._lock:
                    # Its own first unit, so that every source serves some
                    # (a faster stream does not take it), then any.
                    unit = self._first.pop(index, None)
                    if unit is None and self._queue:
                        unit = self._queue.popleft()
                    if unit is None:
                        return
                    if source.address in self._failed:
                        alive = [s for s in self._sources if s.address not in self._failed]
                        if not alive:
                            self._queue.appendleft(unit)
                            return
                        source = alive[index % len(alive)]
                try:
                    self._check_time()
                    if conn is not None and conn.source != source.address:
                        self._release(conn)
                        conn = None
                    if conn is None:
                        conn = self._connect(source)
                    self._landed(unit.start, unit.end)
                    received = self._receive(conn, unit)
                except (SourceFailed, OSError) as exc:
                    with self._lock:
                        self._queue.appendleft(unit)
                    self._fail(source.address, exc)
                    log.warning(
                        "state range %d+%d from %s failed: %s; taking it from another source",
                        unit.start, unit.end - unit.start, source.address, exc,
                    )  # fmt: skip
                    continue
                except PieceFetchFailed:
                    with self._lock:
                        self._queue.appendleft(unit)
                    return
                with self._lock:
                    for piece, value in received:
                        self._hashes[(piece.start, piece.end)] = (value, source.address)
                    self._done += unit.end - unit.start
                    done = self._done
                if self._progress is not None:
                    self._progress(done, self._size)
        finally:
            if conn is not None:
                self._release(conn)

    def _receive(self, conn: DataConnection, unit: Unit) -> list[tuple[Piece, bytes]]:
        """Receive ``unit`` into the buffer, hashing each piece once it is in."""
        length = unit.end - unit.start
        conn.ask(Request(Kind.RANGE, self._expected, unit.start, length), length, exact=True)
        received: list[tuple[Piece, bytes]] = []
        position = unit.start
        batch: list[Piece] = []
        last = unit.pieces[-1]
        for index in unit.pieces:
            piece = self._pieces[index]
            batch.append(piece)
            if piece.end - position < _MIN_READ and index != last:
                continue
            conn.read_into(self._view[position : piece.end])
            received.extend((p, piece_hash(self._view[p.start : p.end])) for p in batch)
            position, batch = piece.end, []
            if self._cancel.is_set():
                raise PieceFetchFailed("state fetch cancelled")
        return received

    def _assembled(self) -> ReplicaState | None:
        """The state, if the pieces received give the agreed digest."""
        decoded = self._decoded
        try:
            if decoded is None:
                raise CorruptState("its header does not decode")
            state = self._state_of(decoded)
            hashes = [self._hashes[(p.start, p.end)][0] for p in self._pieces]
            found = digest_of_pieces(state, by_tensor(self._pieces, hashes, decoded.tensors))
        except (CorruptState, KeyError) as exc:
            found = f"none ({exc})"
        if found == self._expected:
            return state
        log.warning(
            "state %s from %s fails its digest (%s): checking its pieces against a source's "
            "list", self._expected, ", ".join(s.address for s in self._sources), found,
        )  # fmt: skip
        return None

    @staticmethod
    def _state_of(decoded: Decoded) -> ReplicaState:
        state = validated(decoded.tree)
        if state.rng:
            raise CorruptState("a served state carries RNG states, which its digest does not cover")
        return state

    # --- repair -----------------------------------------------------------------------

    def _repair(self) -> tuple[ReplicaState, int]:
        """Take a source's header and piece list as the reference once they
        give the agreed digest, then fetch again every piece that differs."""
        order = sorted(self._sources, key=lambda s: s.address in self._failed)
        for source in order:
            try:
                reference = self._reference(source)
            except SourceFailed as exc:
                log.warning("no list of pieces from %s: %s", source.address, exc)
                self._fail(source.address, exc)
                continue
            except (CorruptState, KeyError) as exc:
                log.warning("corrupt state from %s: its header or list of pieces: %s",
                            source.address, exc)  # fmt: skip
                self._fail(source.address, exc)
                continue
            if reference is None:
                continue
            state, listed = reference
            bad = [
                (piece, value)
                for piece, value in zip(self._pieces, listed, strict=True)
                if self._digest_held(piece) != value
            ]
            culprits = {
                self._hashes[(p.start, p.end)][1]
                for p, _ in bad
                if (p.start, p.end) in self._hashes
            }
            for address in sorted(culprits):
                with self._lock:
                    self._failed.setdefault(address, "delivered pieces that fail the agreed digest")
            log.warning(
                "corrupt state from %s: %d of %d pieces fail the agreed digest (checked against "
                "%s's list); fetching them again from other sources",
                ", ".join(sorted(culprits)) or "no source", len(bad), len(self._pieces),
                source.address,
            )  # fmt: skip
            for piece, value in bad:
                self._refetch(piece, value)
            return state, len(bad)
        raise PieceFetchFailed(
            f"every source delivered state that fails digest {self._expected}: {self._failed}"
        )

    def _reference(self, source: DataSource) -> tuple[ReplicaState, list[bytes]] | None:
        """``source``'s header (now in the buffer) and piece digests, if
        they give the agreed digest (None, and the source counts as failed,
        if not)."""
        self._install(*self._header_of(source))
        self._decode()
        decoded = self._decoded
        if decoded is None:
            raise CorruptState("its header does not decode")
        conn = self._connect(source)
        try:
            count = len(self._pieces)
            conn.ask(Request(Kind.PIECES, self._expected, 0, 0), count * HASH_BYTES, exact=True)
            raw = bytearray(count * HASH_BYTES)
            conn.read_into(memoryview(raw))
        finally:
            self._release(conn)
        listed = [bytes(raw[i : i + HASH_BYTES]) for i in range(0, len(raw), HASH_BYTES)]
        state = self._state_of(decoded)
        found = digest_of_pieces(state, by_tensor(self._pieces, listed, decoded.tensors))
        if found != self._expected:
            self._fail(source.address, f"its header and piece list give digest {found}")
            log.warning(
                "corrupt state from %s: its header and list of pieces give digest %s, not %s",
                source.address, found, self._expected,
            )  # fmt: skip
            return None
        return state, listed

    def _digest_held(self, piece: Piece) -> bytes:
        """The digest of the bytes received for ``piece``."""
        held = self._hashes.get((piece.start, piece.end))
        if held is not None:
            return held[0]
        return piece_hash(self._view[piece.start : piece.end])

    def _refetch(self, piece: Piece, value: bytes) -> None:
        """``piece`` again, from the sources that did not deliver it last,
        until one delivers it with digest ``value``."""
        held = self._hashes.get((piece.start, piece.end))
        last = held[1] if held is not None else None
        order = sorted(self._sources, key=lambda s: (s.address == last, s.address in self._failed))
        length = piece.end - piece.start
        for source in order:
            try:
                conn = self._connect(source)
                try:
                    request = Request(Kind.RANGE, self._expected, piece.start, length)
                    conn.ask(request, length, exact=True)
                    conn.read_into(self._view[piece.start : piece.end])
                finally:
                    self._release(conn)
            except SourceFailed as exc:
                self._fail(source.address, exc)
                continue
            if piece_hash(self._view[piece.start : piece.end]) == value:
                self._hashes[(piece.start, piece.end)] = (value, source.address)
                return
            log.warning("corrupt state from %s: piece %d+%d fails its listed digest",
                        source.address, piece.start, length)  # fmt: skip
            self._fail(source.address, f"piece {piece.start}+{length} fails its listed digest")
        raise PieceFetchFailed(
            f"no source delivered piece {piece.start}+{length} of state {self._expected} "
            f"with its listed digest: {self._failed}"
        )
