"""The ledger: which sample ids every committed step consumed.

Each worker records the whole global step it committed, so the ledgers of a
run merge into one step sequence (:func:`merge_ledgers`) and a test can show
that a run with failures consumed exactly the samples of one without
(:meth:`Ledger.compare`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rollcall.membership.config import Config
from rollcall.membership.errors import UsageError
from rollcall.worker.plan import DataPlan, require_int

#: How many sample ids a :meth:`Ledger.compare` message lists before eliding.
_SHOWN_IDS = 10

#: Seconds between two fsyncs of the ledger file by default
#: (``Config.ledger_sync_interval``): a machine that crashes (power loss,
#: kernel panic) loses at most the records of this long; a killed process
#: loses nothing (every record is flushed when written).
SYNC_INTERVAL = Config().ledger_sync_interval

#: Seconds a file another process holds is waited for by default
#: (``Config.ledger_lock_wait``), and between two tries.
LOCK_WAIT = Config().ledger_lock_wait
_LOCK_POLL = 0.1


@dataclass(frozen=True)
class LedgerEntry:
    """One committed step as the ledger holds it."""

    step: int
    view_epoch: int
    """The membership view's epoch when the step committed."""
    world_size: int
    samples: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "epoch": self.view_epoch,
                "world_size": self.world_size,
                "samples": list(self.samples),
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(line: str) -> LedgerEntry:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a ledger record must be a JSON object, got {line!r}")
        samples = data.get("samples")
        if not isinstance(samples, list):
            raise ValueError(f"ledger record without a sample list: {line!r}")
        return LedgerEntry(
            step=require_int("step", data.get("step"), 0),
            view_epoch=require_int("epoch", data.get("epoch"), 0),
            world_size=require_int("world_size", data.get("world_size"), 1),
            samples=tuple(require_int("sample id", s, 0) for s in samples),
        )


def _not_a_file(path: Path, mode: int) -> ValueError:
    kind = "a directory" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a device"
    return ValueError(
        f"the ledger {path} is {kind}, not a regular file: give the ledger a file path of its "
        "own (a missing file is created)"
    )


def _open_locked(path: Path, wait: float) -> IO[bytes]:
    """``path`` opened for appending under an exclusive lock, or
    :class:`UsageError` if another open file holds the lock for ``wait``
    seconds more. Anything but a regular file is refused
    (:class:`ValueError`): a named pipe blocked the open until a reader
    came, ``/dev/null`` failed the first fsync, naming no path."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):
        raise _not_a_file(path, mode)
    # O_NONBLOCK: a pipe put there since does not block the open.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_a_file(path, mode)
        os.set_blocking(fd, True)
        # Unbuffered: a write the disk refused leaves nothing behind in
        # memory for a later flush to write.
        file = open(fd, "ab", buffering=0)  # noqa: SIM115 - held until close()
    except OSError as error:  # a file of /proc: "[Errno 22] Invalid argument"
        os.close(fd)
        raise OSError(
            error.errno,
            f"the ledger {path} cannot be appended to ({error.strerror}): give the ledger a "
            "file path of its own",
        ) from error
    except ValueError:
        os.close(fd)
        raise
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return file
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(_LOCK_POLL)
    file.close()
    raise UsageError(
        f"the ledger {path} is being written by another worker (or by an Elastic of this "
        f"process not closed yet; waited {wait:g} s for it): each worker needs a ledger file of "
        "its own, and the merged ledgers of a run give its step sequence (rollcall.worker.ledger."
        "merge_ledgers). Put something of the worker's in the path, such as the "
        "ROLLCALL_NAME that `rollcall up` and `rollcall add` give each worker or the "
        'process id: ledger=f"ledger-{os.getpid()}.jsonl"'
    )


def _end_of(path: Path, step: int) -> int:
    """The byte length of the records of ``path`` up to and including
    ``step`` (the file's records are complete lines in step order)."""
    end = 0
    with path.open("rb") as file:
        for raw in file:
            if LedgerEntry.from_json(raw.decode("utf-8")).step > step:
                break
            end += len(raw)
    return end


#: What a record cut short by a killed writer can be: nothing, or the start
#: of ``LedgerEntry.to_json``'s text (``{"step":...``) in its characters.
_TORN = re.compile(rb'(\{("(s(t(ep?)?)?)?)?|\{"step"[0-9a-z_{}\[\]":,]*)?')


def _read_entries(path: Path) -> tuple[list[LedgerEntry], int]:
    """The complete records of the ledger file at ``path`` and the byte length
    they span. A last line without its newline is a write cut short by a
    killed process; it is left out. A malformed complete line is corruption,
    and a last line that is not the start of a record is not one of ours (a
    file of the user's given as the ledger): both raise :class:`ValueError`."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise _not_a_file(path, mode)
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if not _TORN.fullmatch(data[complete:]):
        raise ValueError(
            f"{path}: its last line ({data[complete:][:40]!r}) is not a ledger record cut short "
            "by a killed worker: this is not a ledger file, or one something else wrote into. "
            "Give the ledger a path of its own; nothing was changed"
        )
    entries = []
    for number, raw in enumerate(data[:complete].splitlines(), start=1):
        try:
            entries.append(LedgerEntry.from_json(raw.decode("utf-8")))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError included
            raise ValueError(f"{path}:{number}: bad ledger record: {error}") from error
    return entries, complete


class Ledger:
    """Append-only record of which sample ids each committed step consumed.

    Held in memory and, when ``path`` is given, appended to it as one JSON
    line per step (``{"step", "epoch", "world_size", "samples"}``, ``epoch``
    being the view epoch). Every record is flushed when written, so a step
    the ledger reports survives the process being killed; the file is
    fsynced at most every ``sync_interval`` seconds (at a record) and by
    :meth:`sync`, so a crash of the machine loses at most the records of the
    last ``sync_interval`` seconds (an fsync per step would cost more than a
    small step). A record counts once its newline is in the file.

    An existing file at ``path`` is continued, as a restarted worker does:
    its records are loaded and a torn last line is cut off before the next
    record is appended, so it cannot fuse with it.

    The file is one worker's: it is held under an exclusive ``flock`` until
    :meth:`close`, and a second ``Ledger`` on it, in any process, is refused
    with :class:`UsageError` after waiting ``lock_wait`` seconds for it (two
    workers given one path appended every step twice, and one started later
    took the other's records for its own).
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        sync_interval: float = SYNC_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        lock_wait: float = LOCK_WAIT,
    ) -> None:
        if not sync_interval >= 0:
            raise ValueError(f"sync_interval must be >= 0, got {sync_interval!r}")
        self._path = path
        #: The file, open for appending and locked, while this ledger writes it.
        self._file = None if path is None else _open_locked(path, lock_wait)
        self._entries: dict[int, LedgerEntry] = {}
        self._last: int | None = None
        self._sync_interval, self._clock = sync_interval, clock
        self._synced_at = clock()
        self._unsynced = 0
        #: fsyncs done: the cost the interval bounds, visible to tests.
        self.fsyncs = 0
        #: The length of the file's complete records: where a write that
        #: failed half done is cut back to.
        self._size = 0
        if path is not None and path.exists():
            entries, complete = _read_entries(path)
            for entry in entries:
                self._add(entry)
            if complete < path.stat().st_size:
                os.truncate(path, complete)
            self._size = complete

    def fileno(self) -> int | None:
        """The descriptor of the locked file (None without a file): a
        forked process must close it, or the lock lives as long as it does
        (the runtime's loader workers are told to)."""
        return None if self._file is None or self._file.closed else self._file.fileno()

    def close(self) -> None:
        """Sync the file and release it (another ``Ledger`` may open it
        then). Safe to call again; recording afterwards raises."""
        if self._file is not None and not self._file.closed:
            self.sync()
            self._file.close()

    @property
    def path(self) -> Path | None:
        """The file the ledger appends to, if any."""
        return self._path

    def record(
        self, step: int, view_epoch: int, world_size: int, sample_ids: Sequence[int]
    ) -> None:
        """Record that ``step`` committed having consumed ``sample_ids``.

        The first step recorded may be any step (a worker may join a running
        job); after it, only later steps are accepted. A gap is allowed: a
        worker that pulled state from a peer did not commit the steps in
        between itself (the merged ledgers of the run cover them). A step at
        or before the last one raises :class:`ValueError` and changes nothing.
        """
        entry = LedgerEntry(
            step=require_int("step", step, 0),
            view_epoch=require_int("view_epoch", view_epoch, 0),
            world_size=require_int("world_size", world_size, 1),
            samples=tuple(require_int("sample id", s, 0) for s in sample_ids),
        )
        self._check_next(entry.step)
        if self._file is not None:
            try:
                record = (entry.to_json() + "\n").encode()
                written = 0
                while written < len(record):
                    written += self._file.write(record[written:])
                self._unsynced += 1
                if self._clock() - self._synced_at >= self._sync_interval:
                    self._fsync()
                self._size += written
            except OSError as error:
                with contextlib.suppress(OSError):  # the part written, if any
                    os.ftruncate(self._file.fileno(), self._size)
                raise self._write_failed(error, step) from error
        self._add(entry)

    def _write_failed(self, error: OSError, step: int) -> OSError:
        """A record that could not be written (a full disk, a quota, an I/O
        error): said with the file, the step and what to do."""
        kept = "" if self._last is None else f"; its records up to step {self._last} are kept"
        return OSError(
            error.errno,
            f"the ledger {self._path} could not take the record of step {step} "
            f"({error.strerror or error}): the step was trained and applied, and this worker "
            "stops here. Free space there (or give the ledger another path) and start the "
            f"worker again: it rejoins the job and its ledger goes on from the step it pulls{kept}",
        )

    def rewind(self, step: int) -> int:
        """Forget the records after ``step``: the job resumed from a
        checkpoint of ``step``, so what those steps did is undone and they
        are trained again. The file is cut in place after the last record
        kept (records are in step order; the file stays the one locked).
        Returns how many records were dropped."""
        later = [s for s in self._entries if s > step]
        if not later:
            return 0
        for s in later:
            del self._entries[s]
        self._last = max(self._entries, default=None)
        if self._file is not None and self._path is not None:
            self._size = _end_of(self._path, step)
            os.truncate(self._path, self._size)
            self._unsynced += 1
            self._fsync()
        return len(later)

    def sync(self) -> None:
        """Make every record written so far survive a crash of the machine."""
        if self._file is not None and self._unsynced:
            self._fsync()

    def _fsync(self) -> None:
        assert self._file is not None
        os.fsync(self._file.fileno())
        self.fsyncs += 1
        self._unsynced = 0
        self._synced_at = self._clock()

    def _check_next(self, step: int) -> None:
        if step in self._entries:
            raise ValueError(f"step {step} is already recorded")
        if self._last is not None and step <= self._last:
            raise ValueError(f"step {step} does not come after the last recorded step {self._last}")

    def _add(self, entry: LedgerEntry) -> None:
        self._check_next(entry.step)
        self._entries[entry.step] = entry
        self._last = entry.step

    def refuse_another_plan(self, plan: DataPlan) -> None:
        """The records this file holds must be steps of ``plan``, the data
        plan of the job that the worker opening it trains (a job's plan never
        changes: the fingerprint holds its sizes and seed). A record with
        other samples is another job's (or another data configuration's):
        kept, the file would mix two jobs' steps, and a merge of the run's
        ledgers would take them for this job's. :class:`UsageError`, the
        file left as it is. The first and the last record are compared:
        another order differs in both with near certainty, and the check
        costs two steps' samples however long the file."""
        if not self._entries:
            return
        for step in dict.fromkeys((min(self._entries), max(self._entries))):
            if self._entries[step].samples != plan.step_samples(step):
                raise UsageError(
                    f"the ledger {self._path} holds step {step} with other samples than this "
                    f"worker's data plan gives that step (num_samples={plan.num_samples}, "
                    f"global_batch={plan.global_batch}, micro_batch={plan.micro_batch}, "
                    f"seed={plan.seed}): it was written by another job or with other data "
                    "settings, and this job's steps would be recorded beside its records. Give "
                    "each job a ledger file of its own (another path) or move that one away; "
                    "nothing was trained"
                )

    def steps(self) -> dict[int, tuple[int, ...]]:
        """Step -> the sample ids it consumed, in step order."""
        return {step: entry.samples for step, entry in self._entries.items()}

    def entries(self) -> dict[int, LedgerEntry]:
        """Step -> its full record (view epoch and world size included)."""
        return dict(self._entries)

    @staticmethod
    def load(path: Path) -> Ledger:
        """Read the ledger file at ``path`` without writing to it.

        A torn last line (a process killed mid-write) is ignored; records out
        of step order or a malformed complete line raise :class:`ValueError`.
        The result is in memory only; use ``Ledger(path)`` to continue a file.
        """
        ledger = Ledger()
        for entry in _read_entries(path)[0]:
            ledger._add(entry)
        return ledger

    @staticmethod
    def compare(a: Mapping[int, Sequence[int]], b: Mapping[int, Sequence[int]]) -> list[str]:
        """Human-readable differences of ledger ``b`` from reference ``a``.

        Lists steps missing from ``b``, steps only ``b`` has, and for every
        shared step the ids ``b`` lost or took in addition (or that it took
        the same samples in another order). Over the whole run it then names
        the ids ``b`` consumed fewer times than ``a`` (lost) and more times
        (repeated), which catches a step's samples replayed in a later step.
        An empty list means the ledgers are identical.
        """
        differences = []
        for step in sorted(a.keys() | b.keys()):
            if step not in b:
                differences.append(f"step {step}: missing")
            elif step not in a:
                differences.append(f"step {step}: extra (not in the reference)")
            elif list(a[step]) != list(b[step]):
                want, got = Counter(a[step]), Counter(b[step])
                lost, added = want - got, got - want
                if not lost and not added:
                    differences.append(f"step {step}: same samples in a different order")
                if lost:
                    differences.append(f"step {step}: lost {_describe(lost)}")
                if added:
                    differences.append(f"step {step}: unexpected {_describe(added)}")
        if differences:
            expected = Counter(s for samples in a.values() for s in samples)
            actual = Counter(s for samples in b.values() for s in samples)
            if expected - actual:
                differences.append(f"overall: lost {_describe(expected - actual)}")
            if actual - expected:
                differences.append(f"overall: repeated {_describe(actual - expected)}")
        return differences


def _describe(ids: Counter[int]) -> str:
    """``ids`` sorted, with multiplicity, elided after :data:`_SHOWN_IDS`."""
    listed = sorted(ids.elements())
    shown = ", ".join(str(i) for i in listed[:_SHOWN_IDS])
    if len(listed) > _SHOWN_IDS:
        shown += f", ... ({len(listed)} in all)"
    return f"[{shown}]"


def merge_ledgers(ledgers: Iterable[Mapping[int, Sequence[int]]]) -> dict[int, tuple[int, ...]]:
    """Combine the per-worker ledgers of a run into its global step sequence.

    Each worker records the whole global step when it commits, so ledgers
    that share a step must agree on it exactly; a disagreement raises
    :class:`ValueError` naming the step. The result is in step order.
    """
    merged: dict[int, tuple[int, ...]] = {}
    for index, ledger in enumerate(ledgers):
        for step, samples in ledger.items():
            ids = tuple(samples)
            known = merged.setdefault(step, ids)
            if known != ids:
                raise ValueError(
                    f"step {step}: ledger {index} disagrees with an earlier ledger "
                    f"({len(ids)} vs {len(known)} samples, first ids "
                    f"{list(ids[:_SHOWN_IDS])} vs {list(known[:_SHOWN_IDS])})"
                )
    return dict(sorted(merged.items()))
