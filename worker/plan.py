"""The data plan: which samples every step consumes and which rank runs them.

Pure code. The plan depends on
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

What every committed step did consume is recorded by
:class:`rollcall.worker.ledger.Ledger`.
"""

from __future__ import annotations

import hashlib
import operator
import random
from dataclasses import dataclass, field

#: Domain separation for :func:`microbatch_seed` (blake2b's 16-byte ``person``).
_SEED_PERSON = b"rollcall-mbseed"

#: Domain separation for :func:`load_seed`: the RNG that loading draws from
#: (augmentation) is not the forward pass's, even for the same microbatch.
_LOAD_PERSON = b"rollcall-ldseed"

#: Domain separation for :func:`update_seed`.
_UPDATE_PERSON = b"rollcall-upseed"

#: Data epoch orders :meth:`DataPlan.order` keeps: a straddling step needs two.
_CACHED_ORDERS = 2


def require_int(name: str, value: object, minimum: int | None = None) -> int:
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


def update_seed(seed: int, step: int) -> int:
    """The seed the update of ``step`` runs under: torch, ``random`` and
    numpy are seeded from it right before ``before_update`` and the
    optimizer step, so noise a hook adds to the reduced gradient (DP-SGD,
    gradient noise) is the same on every rank and in every history. Made like
    :func:`microbatch_seed`, under its own domain."""
    return _derived_seed(_UPDATE_PERSON, seed, step, 0)


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


#: The rule ``DataPlan.assignment`` divides a step by, in the job's
#: fingerprint (``data_division``): workers that divide a step differently
#: would run some samples twice and others never. "2": the members fetching
#: state run none of their view's first step, in jobs without sharding or
#: overlap; "3": in overlap jobs too (absent: the rule before, by the world
#: size alone).
DIVISION = "3"


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
        require_int("num_samples", self.num_samples, 1)
        require_int("global_batch", self.global_batch, 1)
        require_int("micro_batch", self.micro_batch, 1)
        require_int("seed", self.seed)
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
        require_int("data_epoch", data_epoch, 0)
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
        require_int("step", step, 0)
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

    def assignment(
        self, step: int, world_size: int, idle: frozenset[int] = frozenset()
    ) -> tuple[tuple[int, ...], ...]:
        """Per rank, the microbatch indices it runs at ``step``.

        Contiguous blocks in rank order whose sizes differ by at most one, the
        larger blocks going to the lower ranks. With more ranks than
        microbatches, the highest ranks get none. The split depends only on
        the world size and ``idle``: ranks that run nothing at this step (a
        view's first step, while they fetch the state: ``Elastic``), the
        others dividing the step as a world of their number would, in rank
        order.
        """
        require_int("step", step, 0)
        require_int("world_size", world_size, 1)
        if any(not 0 <= rank < world_size for rank in idle):
            raise ValueError(f"idle ranks {sorted(idle)} are not all ranks of {world_size}")
        if len(idle) >= world_size:
            raise ValueError(f"idle ranks {sorted(idle)} leave no rank to run step {step}")
        active = [rank for rank in range(world_size) if rank not in idle]
        base, extra = divmod(self.num_microbatches, len(active))
        blocks: list[tuple[int, ...]] = [() for _ in range(world_size)]
        start = 0
        for position, rank in enumerate(active):
            size = base + (1 if position < extra else 0)
            blocks[rank] = tuple(range(start, start + size))
            start += size
        return tuple(blocks)

    @staticmethod
    def lightest_rank(world_size: int) -> int:
        """A rank ``assignment`` gives the fewest microbatches at every step:
        the last one (the larger blocks go to the lower ranks)."""
        require_int("world_size", world_size, 1)
        return world_size - 1

    def for_rank(
        self, step: int, rank: int, world_size: int, idle: frozenset[int] = frozenset()
    ) -> tuple[Microbatch, ...]:
        """The microbatches ``rank`` of ``world_size`` runs at ``step``
        (``idle``: as ``assignment``)."""
        blocks = self.assignment(step, world_size, idle)
        require_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        every = self.microbatches(step)
        return tuple(every[index] for index in blocks[rank])
