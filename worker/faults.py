"""Fault injection for the fault-matrix tests, off unless asked for.

A worker started with ``ROLLCALL_FAULTS`` in its environment injects the
faults named there into its own behaviour, so that a test can reach code
paths no outside action produces reliably. The value is a comma-separated
list of ``name=count`` items:

- ``corrupt_serves=N``: the state server flips one byte in each of its next
  N answers of state bytes (a peer whose memory or disk corrupted the state
  it serves): the first byte of a range asked over its data channel, the
  middle byte of the first chunk of a ``Fetch`` answer. The fetching worker
  must detect it by the digest and take the bytes from another source.
- ``slow_describes=N``: the state server answers each of its next N
  ``Describe`` calls ``SLOW_DESCRIBE_S`` late (a loaded or distant peer):
  a fetch from it outlasts the fetching worker's group build.
- ``slow_answers=N``: each of the worker's next N answers to a roll call
  takes ``SLOW_ANSWER_S`` longer to capture and digest its state (a large
  state on a busy machine).
- ``slow_lands=N``: the worker lands each of its next N steps
  ``SLOW_LAND_S`` after their reduction completed (a process descheduled
  on a busy machine): the others, done with that step, may already have
  moved on, or left the job after its last step.
- ``slow_builds=N``: each of the worker's next N group builds starts
  ``SLOW_BUILD_S`` late (a peer slow to connect on a busy machine).
- ``failed_leaves=N``: the worker's next N ``Leave`` calls fail without
  reaching the service (a leader unreachable just then): the others learn
  of the leave only when the worker's session ends with its process.
- ``diverge_steps=N``: after each of the next N steps it lands, the worker
  nudges one parameter by one unit in the last place (a kernel, a library
  version or a CPU that computes differently on this worker): its replica
  drifts from the others' without anything in a step showing it (in a
  sharded job, its first copy of a partition drifts from the other
  owners').
- ``held_gather_exits=N``: in a sharded job, the worker's process exits
  (``os._exit``, no cleanup: a kill) at the parameter all-gather of a step
  that a roll call held at that step's end waits for (a joiner's), once
  its update landed: the others' all-gather fails, their step landed, and
  the roll call is answered before their loop's code after ``commit()``
  has run (a kill at the worst moment of a hot-add). N is at most 1 in
  effect.
- ``held_states=N``: the training thread holds the lock of the worker's
  protocol state ``HELD_STATE_S`` longer at each of its next N fence
  checks (a thread descheduled inside it): a signal that arrives then is
  handled while this thread holds that lock.

Every injected fault is logged at WARNING. An unknown name or a malformed
count is an error at start: a misspelt fault must not pass silently as "no
fault".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The environment variable naming the faults to inject.
ENV = "ROLLCALL_FAULTS"
#: How late a ``slow_describes`` fault answers.
SLOW_DESCRIBE_S = 1.0
#: How much longer a ``slow_answers`` fault takes to answer a roll call:
#: more than half the deadline of a roll call held at the step's end (1.5 s
#: by default, ``Config.answer_deadline``), less than any roll call's.
SLOW_ANSWER_S = 0.8
#: How late a ``slow_lands`` fault lands a step: less than
#: ``rollcall_step_end_wait`` (0.5 s), the longest a roll call waits for
#: the end of a step.
SLOW_LAND_S = 0.3
#: How late a ``slow_builds`` fault starts a group build.
SLOW_BUILD_S = 1.0
#: How much longer a ``held_states`` fault holds the protocol state's lock.
HELD_STATE_S = 1.0


@dataclass
class Faults:
    """Counts of faults still to inject (all zero: none)."""

    corrupt_serves: int = 0
    slow_describes: int = 0
    slow_answers: int = 0
    slow_lands: int = 0
    slow_builds: int = 0
    failed_leaves: int = 0
    diverge_steps: int = 0
    held_gather_exits: int = 0
    held_states: int = 0

    @classmethod
    def parse(cls, text: str) -> Faults:
        """Faults from ``name=count[,name=count...]``; raises ``ValueError``
        naming the bad item."""
        faults = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in cls.__dataclass_fields__:
                known = ", ".join(cls.__dataclass_fields__)
                raise ValueError(f"{ENV}: unknown fault {item!r} (known: {known}, as name=count)")
            if not value.isdigit():
                raise ValueError(f"{ENV}: count of {name} must be a whole number, got {value!r}")
            setattr(faults, name, int(value))
        return faults

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV, ""))

    def slow_describe(self) -> bool:
        """Whether to answer this ``Describe`` late (using a
        ``slow_describes`` fault up if one is left)."""
        return self._late("slow_describes", "answering a Describe", SLOW_DESCRIBE_S)

    def slow_answer(self) -> bool:
        """Whether to answer this roll call late (using a ``slow_answers``
        fault up if one is left)."""
        return self._late("slow_answers", "answering a roll call", SLOW_ANSWER_S)

    def slow_land(self) -> bool:
        """Whether to land this step late (using a ``slow_lands`` fault up
        if one is left)."""
        return self._late("slow_lands", "landing a step", SLOW_LAND_S)

    def slow_build(self) -> bool:
        """Whether to start this group build late (using a ``slow_builds``
        fault up if one is left)."""
        return self._late("slow_builds", "building a group", SLOW_BUILD_S)

    def failed_leave(self) -> bool:
        """Whether this ``Leave`` call fails (using a ``failed_leaves``
        fault up if one is left)."""
        return self._used("failed_leaves", "a Leave call fails")

    def diverge(self) -> bool:
        """Whether to nudge this replica's parameters after the step just
        landed (using a ``diverge_steps`` fault up if one is left)."""
        return self._used("diverge_steps", "this replica's parameters drift from the others'")

    def held_gather_exit(self) -> bool:
        """Whether to exit at this all-gather, a roll call waiting for the
        step's end (using a ``held_gather_exits`` fault up if one is left)."""
        return self._used("held_gather_exits", "the process exits at the all-gather")

    def held_state(self) -> bool:
        """Whether to hold the protocol state's lock longer at this fence
        check (using a ``held_states`` fault up if one is left)."""
        return self._late("held_states", "releasing the protocol state's lock", HELD_STATE_S)

    def _late(self, name: str, what: str, seconds: float) -> bool:
        return self._used(name, f"{what} {seconds:.1f} s late")

    def _used(self, name: str, what: str) -> bool:
        """Whether a fault ``name`` is left, using one up (logged as ``what``)."""
        left = getattr(self, name)
        if left <= 0:
            return False
        setattr(self, name, left - 1)
        log.warning("fault injection: %s (%d more)", what, left - 1)
        return True

    def corrupt(self, data: bytes, at: int | None = None) -> bytes:
        """``data`` with one byte flipped (the one at ``at``, default the
        middle one) if a ``corrupt_serves`` fault is left (using it up),
        else ``data`` itself."""
        if self.corrupt_serves <= 0 or not data:
            return data
        self.corrupt_serves -= 1
        log.warning("fault injection: corrupting a state chunk (%d more)", self.corrupt_serves)
        index = len(data) // 2 if at is None else at
        return data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1 :]
