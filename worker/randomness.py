"""Random generators the user's objects hold, seeded per microbatch.

The runtime seeds torch's, ``random``'s and numpy's global generators from
each microbatch's seed before the microbatch is loaded and again before it is
handed to the loop, so what a microbatch computes depends on ``(seed, step,
index)`` alone, whichever process or rank runs it and whatever ran before.
A generator of the user's own, kept by the data set, its collate function or
a module of the model (``self.rng = numpy.random.default_rng(0)`` for an
augmentation, a ``torch.Generator`` for a custom dropout), would instead go
on from wherever that process left it: another history (another world size,
a worker that joined) would draw other numbers, and exact mode would give
other bits with no word. :func:`held_generators` finds such generators once,
by walking the objects' attributes; :func:`seed_held` seeds each of them from
the microbatch's seed and its place in that list. :class:`ModelGenerators`
looks at the model again when a process's first microbatch is handed out
(a generator assigned after ``Elastic(...)``) and after its loop body (one
the first forward pass made, which exact mode refuses).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from rollcall.membership.errors import UsageError
from rollcall.worker.reach import reach

try:
    import numpy
except ImportError:  # pragma: no cover - torch wheels bring numpy
    numpy = None  # type: ignore[assignment]

__all__ = ["ModelGenerators", "held_generators", "seed_held"]

log = logging.getLogger("rollcall.worker")


def _generator_types() -> tuple[type, ...]:
    kinds: list[type] = [torch.Generator, random.Random]
    if numpy is not None:
        kinds += [numpy.random.Generator, numpy.random.RandomState]
    return tuple(kinds)


def _global_generators() -> set[int]:
    """The global generators, which the runtime seeds itself."""
    ids = {id(torch.default_generator), id(random._inst)}  # type: ignore[attr-defined]
    if numpy is not None:
        ids.add(id(numpy.random.mtrand._rand))
    return ids


def held_generators(*objects: Any) -> tuple[Any, ...]:
    """The random generators (``torch.Generator``, ``random.Random``,
    numpy's ``Generator`` and ``RandomState``) that ``objects`` hold, in a
    fixed order: the objects themselves, their attributes and the items of
    their lists, tuples and dicts, down to a few levels, each once; not
    torch's, ``random``'s or numpy's global generator. A module's
    submodules are not walked into: pass each (``*model.modules()``)."""
    kinds = _generator_types()
    skipped = _global_generators()
    roots = [("", obj) for obj in objects]
    return tuple(obj for _, obj in reach(roots, stop=kinds)
                 if isinstance(obj, kinds) and id(obj) not in skipped)  # fmt: skip


def seed_held(generators: Sequence[Any], seed: int) -> None:
    """Seed each of ``generators`` (from :func:`held_generators`) from
    ``seed`` and its place in the list: two generators never draw the same
    numbers, and each draws the same ones for the same ``seed``."""
    for place, generator in enumerate(generators):
        text = f"{seed}:{place}".encode("ascii")
        digest = hashlib.blake2b(text, digest_size=8, person=b"rollcall-held").digest()
        value = int.from_bytes(digest, "big") >> 1
        if isinstance(generator, torch.Generator):
            generator.manual_seed(value)
        elif isinstance(generator, random.Random):
            generator.seed(value)
        elif isinstance(generator, numpy.random.RandomState):
            generator.seed([value & 0xFFFF_FFFF, value >> 32])
        else:  # numpy.random.Generator: a fresh bit generator of its kind
            bits = generator.bit_generator
            bits.state = type(bits)(value).state


class ModelGenerators:
    """The generators ``model``'s modules hold, seeded per microbatch.

    Found when the process's first microbatch is handed out, not when
    ``Elastic(...)`` is built: a script may assign one in between. Looked
    for once more after that microbatch's loop body: a generator the first
    forward pass made (``if self.rng is None: self.rng = ...``) drew that
    microbatch's numbers from wherever it was made, which depends on the
    process, not on the microbatch. Exact mode refuses it; otherwise it is
    seeded from the next microbatch on. Looking costs a walk over the
    modules, so it is done at those two points only."""

    def __init__(self, model: torch.nn.Module, *, exact: bool) -> None:
        self._model = model
        self._exact = exact
        self._held: tuple[Any, ...] | None = None
        self._checked = False

    def seed(self, seed: int) -> None:
        """Seed the held generators for a microbatch of ``seed``."""
        if self._held is None:
            self._held = held_generators(*self._model.modules())
        seed_held(self._held, seed)

    def check_after_first(self) -> None:
        """After the process's first microbatch: refuse (exact) or take in
        a generator that microbatch made."""
        if self._checked or self._held is None:
            return
        self._checked = True
        now = held_generators(*self._model.modules())
        before = {id(g) for g in self._held}
        made = [g for g in now if id(g) not in before]
        self._held = now
        if not made:
            return
        where = ", ".join(self._where(g) for g in made)
        if self._exact:
            raise UsageError(
                f"exact mode: the model made a random generator during this process's first "
                f"microbatch ({where}). What that microbatch drew from it depends on which "
                "process ran it first, not on the microbatch, so another world size or a "
                "worker that joins would compute other bits. Make it when the model is built "
                "(in __init__) or before the first step, or draw from torch's generator, which "
                "the runtime seeds for every microbatch"
            )
        log.info(
            "the model made a random generator during this process's first microbatch (%s): "
            "seeded for every microbatch from the next one on", where,
        )  # fmt: skip

    def _where(self, generator: Any) -> str:
        kind = f"a {type(generator).__module__.split('.')[0]}.{type(generator).__name__}"
        reached = reach(list(self._model.named_modules()), stop=_generator_types())
        path = next((path for path, obj in reached if obj is generator), "")
        return f"{path}: {kind}" if path else kind
