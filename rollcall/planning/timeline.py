"""Where a job's time goes: progress (in steps) at the rate its live ranks
allow, durable checkpoints every K steps, and every second of wall time
charged to one category, useful or a loss. The systems say when the job is
held up and why (``block`` / ``unblock``) and how many ranks train
(``capacity``); ``advance`` moves time forward in closed form, so a quiet
stretch of a thousand checkpoint intervals costs one call."""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass


class Category(enum.Enum):
    """What a second of wall time was spent on."""

    USEFUL = "useful"
    #: Held up until a real failure is noticed (a crash's signal, or the
    #: detector's timeout for a silent one).
    DETECTION = "detection"
    #: Everything a healthy but paused rank's eviction costs: the wait until
    #: the detector fires, the view changes it causes, its replacement's join.
    FALSE_EVICTION = "false evictions"
    #: Held up by a paused rank that the detector sat out.
    PAUSES = "pauses sat out"
    #: Roll call, group rebuild, state transfer and the aborted step; a
    #: launcher's relaunch and checkpoint load; a replica group's quorum and
    #: heal. For real failures and their replacements.
    RECONFIGURATION = "reconfiguration"
    #: Steps computed again after a restart from a checkpoint.
    REPLAY = "replay"
    #: Training blocked while a checkpoint is written.
    CHECKPOINT = "checkpoint writes"
    #: Rate lost while fewer ranks train than the job has.
    MISSING = "ranks missing"


LOSSES = tuple(c for c in Category if c is not Category.USEFUL)

#: A checkpoint boundary (or the end of its write) this close, in seconds,
#: counts as reached, so that rounding does not decide whether a checkpoint
#: was written at the very moment time stops.
_REACHED = 1e-9

#: When several things hold the job up at once, the time goes to the first of
#: them in this order.
PRECEDENCE = (
    Category.RECONFIGURATION,
    Category.FALSE_EVICTION,
    Category.DETECTION,
    Category.PAUSES,
)


@dataclass(frozen=True)
class Breakdown:
    """Seconds of wall time per category over a window; goodput is the
    useful share."""

    seconds: tuple[tuple[Category, float], ...]

    @property
    def wall_s(self) -> float:
        return sum(s for _, s in self.seconds)

    def of(self, category: Category) -> float:
        return dict(self.seconds).get(category, 0.0)

    def share(self, category: Category) -> float:
        wall = self.wall_s
        return self.of(category) / wall if wall > 0 else 0.0

    @property
    def goodput(self) -> float:
        return self.share(Category.USEFUL)


class Timeline:
    """Progress and time accounting of one simulated job. Time only moves
    forward, through ``advance``."""

    def __init__(self, step_s: float, checkpoint_every: int | None, write_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s
        self._every = checkpoint_every
        self._write_s = write_s
        #: Steps done (may fall back to ``durable`` on a restart), the most
        #: ever done, and the step of the last complete checkpoint.
        self.progress = 0.0
        self.high = 0.0
        self.durable = 0.0
        self._boundary = float(checkpoint_every) if checkpoint_every else math.inf
        #: Seconds of checkpoint write left (0: computing).
        self._writing = 0.0
        self.capacity = 1.0
        self._blocks: dict[Hashable, Category] = {}
        self._held: Counter[Category] = Counter()
        self._seconds: dict[Category, float] = dict.fromkeys(Category, 0.0)

    # ------------------------------------------------------------- holding up

    def block(self, key: Hashable, category: Category) -> None:
        """Hold the job up for ``category`` until ``unblock(key)``."""
        old = self._blocks.get(key)
        if old is not None:
            self._held[old] -= 1
        self._blocks[key] = category
        self._held[category] += 1

    def unblock(self, key: Hashable) -> None:
        category = self._blocks.pop(key, None)
        if category is not None:
            self._held[category] -= 1

    def blocked_by(self) -> Category | None:
        for category in PRECEDENCE:
            if self._held[category] > 0:
                return category
        return None

    # ------------------------------------------------------------------ time

    def advance(self, to: float) -> None:
        dt = to - self.now
        if dt <= 0:
            return
        self.now = to
        holder = self.blocked_by()
        if holder is not None:
            self._seconds[holder] += dt
        elif self.capacity <= 0:
            self._seconds[Category.MISSING] += dt
        else:
            self._run(dt)

    def restore(self) -> None:
        """Every rank lost the state: back to the last complete checkpoint
        (a write under way is lost too)."""
        self.progress = self.durable
        self._writing = 0.0
        if self._every:
            self._boundary = self.durable + self._every

    def breakdown(self) -> Breakdown:
        return Breakdown(tuple((c, s) for c, s in self._seconds.items() if s > 0))

    # -------------------------------------------------------------- progress

    def _run(self, dt: float) -> None:
        rate = self.capacity / self.step_s  # steps per second
        while dt > 0:
            if self._writing > 0:
                spent = min(dt, self._writing)
                self._seconds[Category.CHECKPOINT] += spent
                self._writing -= spent
                dt -= spent
                if self._writing <= _REACHED:  # as a boundary: rounding decides nothing
                    self._writing = 0.0
                    self.durable = self._boundary
                    self._boundary += self._every or math.inf
                continue
            to_boundary = (self._boundary - self.progress) / rate
            if to_boundary > dt + _REACHED:
                self._gain(dt, rate)
                return
            if self._every and self.progress == self._boundary - self._every:
                # At the start of a cycle: skip whole cycles in one go.
                cycle = self._every / rate + self._write_s
                cycles = math.floor((dt + _REACHED) / cycle)
                if cycles >= 1:
                    self._gain(cycles * self._every / rate, rate)
                    self._seconds[Category.CHECKPOINT] += cycles * self._write_s
                    dt = max(dt - cycles * cycle, 0.0)
                    self.progress = self._boundary + (cycles - 1) * self._every
                    self.high = max(self.high, self.progress)
                    self.durable = self.progress
                    self._boundary = self.progress + self._every
                    continue
            self._gain(min(to_boundary, dt), rate)
            dt = max(dt - to_boundary, 0.0)
            self.progress = self._boundary
            self.high = max(self.high, self.progress)
            self._writing = self._write_s
            if self._writing <= 0:
                self.durable = self._boundary
                self._boundary += self._every or math.inf

    def _gain(self, seconds: float, rate: float) -> None:
        steps = seconds * rate
        new = max(0.0, self.progress + steps - max(self.progress, self.high))
        self._seconds[Category.USEFUL] += new * self.step_s
        self._seconds[Category.REPLAY] += (steps - new) * self.step_s
        self._seconds[Category.MISSING] += seconds * (1.0 - self.capacity)
        self.progress += steps
        self.high = max(self.high, self.progress)
