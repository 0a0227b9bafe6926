"""The event loop of one simulated job, shared by the three systems: faults
from the trace and the system's own later events (a detection, the end of
a relaunch, a replacement's arrival) in time order, timed holds on the job,
and which slots are not training.

Only slots that are not training are kept (``out``), so a 100,000-rank job
costs what its faults cost."""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any

from rollcall.planning.costs import Costs
from rollcall.planning.errors import BadJob
from rollcall.planning.job import Host, Job
from rollcall.planning.timeline import Category, Timeline
from rollcall.planning.trace import Failure, Pause, Trace


class Slot(enum.Enum):
    """Why a slot's rank is not training."""

    FAILED = "failed"  # dead (or about to be found dead)
    PAUSED = "paused"  # stopped for a while; still a member
    EVICTED = "evicted"  # paused, then dropped from the job
    STARTING = "starting"  # its replacement is starting or joining


class Engine:
    """Subclasses say what a failure and a pause do (``on_failure``,
    ``on_pause``) and schedule their consequences with ``at``."""

    def __init__(self, job: Job, host: Host, costs: Costs, timeout: float, trace: Trace) -> None:
        if trace.slots != job.ranks:
            raise BadJob(f"a trace of {trace.slots} slots for a job of {job.ranks} ranks")
        self.job = job
        self.host = host
        self.costs = costs
        self.timeout = timeout
        self.timeline = Timeline(job.step_s, job.checkpoint_every, job.checkpoint_write_s)
        self.out: dict[int, Slot] = {}
        self.failures_hit = 0
        self.pauses_hit = 0
        self._trace = trace
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._until: dict[Hashable, float] = {}
        self._keys = itertools.count()

    @property
    def now(self) -> float:
        return self.timeline.now

    # -------------------------------------------------------------- scheduling

    def at(self, time: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(time, self.now), next(self._seq), action, args))

    def hold(self, key: Hashable, category: Category, until: float) -> None:
        """Hold the job up for ``category`` until ``until`` (a later hold
        under the same key extends it)."""
        if until <= self.now:
            return
        previous = self._until.get(key)
        if previous is not None and previous >= until:
            return
        self._until[key] = until
        self.timeline.block(key, category)
        self.at(until, self._expire, key, until)

    def hold_once(self, category: Category, until: float) -> None:
        self.hold(("once", next(self._keys)), category, until)

    def release(self, key: Hashable) -> None:
        self._until.pop(key, None)
        self.timeline.unblock(key)

    def _expire(self, key: Hashable, until: float) -> None:
        if self._until.get(key) == until:
            self.release(key)

    # ------------------------------------------------------------------- slots

    def ready(self, slot: int) -> bool:
        return slot not in self.out

    def ready_slot(self, slot: int) -> int | None:
        """``slot`` if its rank is training, else the next one that is."""
        n = self.job.ranks
        if len(self.out) >= n:
            return None
        for i in range(n):
            candidate = (slot + i) % n
            if self.ready(candidate):
                return candidate
        return None

    # -------------------------------------------------------------------- loop

    def run(self, until: float | None) -> float:
        """Play the trace (to ``until``, or until nothing is left to happen)
        and return the end time."""
        faults = self._trace.faults
        i = 0
        last = 0.0
        while True:
            next_fault = faults[i].at if i < len(faults) else math.inf
            next_event = self._heap[0][0] if self._heap else math.inf
            t = min(next_fault, next_event)
            if t == math.inf or (until is not None and t > until):
                break
            self.timeline.advance(t)
            if next_event <= next_fault:
                _, _, action, args = heapq.heappop(self._heap)
                action(*args)
            else:
                fault = faults[i]
                i += 1
                if isinstance(fault, Failure):
                    self.on_failure(fault)
                else:
                    self.on_pause(fault)
            last = t
        end = until if until is not None else last
        self.timeline.advance(end)
        return end

    def on_failure(self, failure: Failure) -> None:
        raise NotImplementedError

    def on_pause(self, pause: Pause) -> None:
        raise NotImplementedError
