"""The data plan: which samples every step consumes and which rank runs them.

Pure code apart from the ledger's file. The plan depends on
``(num_samples, global_batch, micro_batch, seed)`` only, never on the world
size, so a run whose world shrinks or grows consumes exactly the samples a run
of constant size would (DESIGN.md, "Data: no sample lost, none counted twice"):

* each data epoch has one global order, a seeded permutation of the dataset;
* the epoch orders are concatenated into one stream and step ``s`` consumes
  the ``global_batch`` samples that start at ``s * global_batch`` in it, so a
  step may take the tail of epoch ``e`` and the head of epoch ``e + 1``;
* a step is cut into ``global_batch // micro_batch`` microbatches, which are
  divided among the ranks of the current view in contiguous, near-even blocks;
* each microbatch carries a seed derived from ``(seed, step, index)`` alone,
  so its randomness does not depend on the rank that runs it; loading it has
  a seed of its own (:func:`load_seed`), derived the same way.

The :class:`Ledger` records the samples every committed step consumed, so a
test can show that a run with failures consumed the same samples as one
without.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: How many sample ids a :meth:`Ledger.compare` message lists before eliding.
_SHOWN_IDS = 10

#: Domain separation for :func:`microbatch_seed` (blake2b's 16-byte ``person``).
_SEED_PERSON = b"rollcall-mbseed"

#: Domain separation for :func:`load_seed`: the RNG that loading draws from
#: (augmentation) is not the forward pass's, even for the same microbatch.
_LOAD_PERSON = b"rollcall-ldseed"

#: Data epoch orders :meth:`DataPlan.order` keeps: a straddling step needs two.
_CACHED_ORDERS = 2


def _require_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int (numpy and torch integer scalars included), or
    :class:`ValueError`. A bool is refused: it is a flag passed by mistake."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def microbatch_seed(seed: int, step: int, index: int) -> int:
    """The seed of microbatch ``index`` of ``step`` under plan seed ``seed``.

    The first 8 bytes of a blake2b digest of the decimal text
    ``"{seed}:{step}:{index}"``, shifted right by one bit: a well-mixed
    63-bit non-negative int, so it fits a signed 64-bit seed
    (``torch.manual_seed``, ``torch.Generator``). Neighbouring steps and
    indices get unrelated seeds, and the value is the same in every process,
    on every machine and Python version, since it hashes text and not Python
    objects.
    """
    return _derived_seed(_SEED_PERSON, seed, step, index)


def load_seed(seed: int, step: int, index: int) -> int:
    """The seed that loading microbatch ``index`` of ``step`` runs under.

    torch, ``random`` and numpy are seeded from it right before the
    microbatch's samples are read and collated, so augmentation drawn in a
    dataset's ``__getitem__`` is the same whichever process, loader worker or
    rank loads it. Made like :func:`microbatch_seed` (same text, same 63-bit
    range) but under its own domain, so the two streams are unrelated.
    """
    return _derived_seed(_LOAD_PERSON, seed, step, index)


def _derived_seed(person: bytes, seed: int, step: int, index: int) -> int:
    text = f"{seed}:{step}:{index}".encode("ascii")
    digest = hashlib.blake2b(text, digest_size=8, person=person).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class Microbatch:
    """``micro_batch`` consecutive samples of one step's share of the order."""

    step: int
    """The global step the microbatch belongs to."""
    index: int
    """Position within the step, ``0 .. num_microbatches - 1``."""
    sample_ids: tuple[int, ...]
    """Dataset indices, ``micro_batch`` of them."""
    seed: int
    """:func:`microbatch_seed` of ``(plan seed, step, index)``; never the rank."""


@dataclass(frozen=True)
class DataPlan:
    """One global sample order per data epoch, independent of the world size.

    Raises :class:`ValueError` unless all sizes are positive ints,
    ``micro_batch`` divides ``global_batch`` and ``global_batch`` is at most
    ``num_samples`` (so a step spans at most two data epochs).
    """

    num_samples: int
    global_batch: int
    micro_batch: int
    seed: int
    # The most recent orders, newest first. Replaced whole, never mutated, so
    # threads sharing a plan at worst compute an order twice.
    _recent: tuple[tuple[int, tuple[int, ...]], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _require_int("num_samples", self.num_samples, 1)
        _require_int("global_batch", self.global_batch, 1)
        _require_int("micro_batch", self.micro_batch, 1)
        _require_int("seed", self.seed)
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a multiple of "
                f"micro_batch ({self.micro_batch})"
            )
        if self.global_batch > self.num_samples:
            raise ValueError(
                f"global_batch ({self.global_batch}) must not exceed "
                f"num_samples ({self.num_samples})"
            )

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step: ``global_batch // micro_batch``."""
        return self.global_batch // self.micro_batch

    def samples_per_step(self) -> int:
        """Samples every step consumes, whatever the world size."""
        return self.global_batch

    def order(self, data_epoch: int) -> tuple[int, ...]:
        """The order of data epoch ``data_epoch``: a permutation of the dataset.

        A Fisher-Yates shuffle driven by ``random.Random("{seed}:{data_epoch}")``.
        Only ``Random.random()`` is used, together with seeding from a str:
        the two parts of the module whose output Python promises not to change
        between versions (``Random.shuffle`` and ``randrange`` carry no such
        promise), so every process on every machine derives the same order.
        """
        _require_int("data_epoch", data_epoch, 0)
        for cached_epoch, cached in self._recent:
            if cached_epoch == data_epoch:
                return cached
        rng = random.Random(f"{self.seed}:{data_epoch}")
        ids = list(range(self.num_samples))
        for i in range(self.num_samples - 1, 0, -1):
            j = int(rng.random() * (i + 1))
            ids[i], ids[j] = ids[j], ids[i]
        result = tuple(ids)
        recent = ((data_epoch, result), *self._recent[: _CACHED_ORDERS - 1])
        object.__setattr__(self, "_recent", recent)
        return result

    def position(self, step: int) -> tuple[int, int]:
        """``(data_epoch, offset)`` of the first sample of ``step`` (0-based)."""
        _require_int("step", step, 0)
        data_epoch, offset = divmod(step * self.global_batch, self.num_samples)
        return data_epoch, offset

    def step_samples(self, step: int) -> tuple[int, ...]:
        """The ``global_batch`` sample ids of ``step``, in order.

        A step that straddles two data epochs takes the tail of the first and
        the head of the next; it may then hold an id twice, once per epoch.
        """
        data_epoch, offset = self.position(step)
        end = offset + self.global_batch
        head = self.order(data_epoch)[offset:end]
        if end <= self.num_samples:
            return head
        return head + self.order(data_epoch + 1)[: end - self.num_samples]

    def microbatches(self, step: int) -> tuple[Microbatch, ...]:
        """All microbatches of ``step``, by index."""
        samples = self.step_samples(step)
        size = self.micro_batch
        return tuple(
            Microbatch(
                step=step,
                index=index,
                sample_ids=samples[index * size : (index + 1) * size],
                seed=microbatch_seed(self.seed, step, index),
            )
            for index in range(self.num_microbatches)
        )

    def assignment(self, step: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        """Per rank, the microbatch indices it runs at ``step``.

        Contiguous blocks in rank order whose sizes differ by at most one, the
        larger blocks going to the lower ranks. With more ranks than
        microbatches, the highest ranks get none. The split depends only on
        the world size; every step is divided the same way.
        """
        _require_int("step", step, 0)
        _require_int("world_size", world_size, 1)
        base, extra = divmod(self.num_microbatches, world_size)
        blocks = []
        start = 0
        for rank in range(world_size):
            size = base + (1 if rank < extra else 0)
            blocks.append(tuple(range(start, start + size)))
            start += size
        return tuple(blocks)

    def for_rank(self, step: int, rank: int, world_size: int) -> tuple[Microbatch, ...]:
        """The microbatches ``rank`` of ``world_size`` runs at ``step``."""
        blocks = self.assignment(step, world_size)
        _require_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        every = self.microbatches(step)
        return tuple(every[index] for index in blocks[rank])


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
            step=_require_int("step", data.get("step"), 0),
            view_epoch=_require_int("epoch", data.get("epoch"), 0),
            world_size=_require_int("world_size", data.get("world_size"), 1),
            samples=tuple(_require_int("sample id", s, 0) for s in samples),
        )


def _read_entries(path: Path) -> tuple[list[LedgerEntry], int]:
    """The complete records of the ledger file at ``path`` and the byte length
    they span. A last line without its newline is a write cut short by a
    killed process; it is left out. A malformed complete line is corruption
    and raises :class:`ValueError`."""
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
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
    being the view epoch), flushed and fsynced line by line, so a step the
    ledger reports survives the process. A record counts
    once its newline is on disk.

    An existing file at ``path`` is continued, as a restarted worker does:
    its records are loaded and a torn last line is cut off before the next
    record is appended, so it cannot fuse with it.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._entries: dict[int, LedgerEntry] = {}
        self._last: int | None = None
        if path is not None and path.exists():
            entries, complete = _read_entries(path)
            for entry in entries:
                self._add(entry)
            if complete < path.stat().st_size:
                os.truncate(path, complete)

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
            step=_require_int("step", step, 0),
            view_epoch=_require_int("view_epoch", view_epoch, 0),
            world_size=_require_int("world_size", world_size, 1),
            samples=tuple(_require_int("sample id", s, 0) for s in sample_ids),
        )
        self._check_next(entry.step)
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as file:
                # Flushed, not fsynced: a killed process loses nothing
                # flushed; an fsync per step would cost more than the step.
                file.write(entry.to_json() + "\n")
                file.flush()
        self._add(entry)

    def _check_next(self, step: int) -> None:
        if step in self._entries:
            raise ValueError(f"step {step} is already recorded")
        if self._last is not None and step <= self._last:
            raise ValueError(
                f"step {step} does not come after the last recorded step {self._last}"
            )

    def _add(self, entry: LedgerEntry) -> None:
        self._check_next(entry.step)
        self._entries[entry.step] = entry
        self._last = entry.step

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
