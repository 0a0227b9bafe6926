"""What is simulated: the training job, the host it runs on, the faults it
meets, and which recovery system it uses. Values only; every check of a
setting's range is here, so a bad input fails before any simulation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from rollcall.planning.errors import BadJob


class System(enum.Enum):
    """The three ways of living with failures that the simulator compares."""

    #: Survivors carry on: roll call, new group, a joiner fetches the state.
    ROLLCALL = "rollcall"
    #: Every membership change restarts every rank from the last checkpoint.
    LAUNCHER = "launcher"
    #: A rank's failure takes its replica group out; the others go on
    #: without its samples, and the group heals from a peer when back.
    REPLICA_GROUPS = "replica groups"

    @property
    def label(self) -> str:
        return LABELS[self]


LABELS = {
    System.ROLLCALL: "rollcall",
    System.LAUNCHER: "restart-from-checkpoint (torchrun-like)",
    System.REPLICA_GROUPS: "replica groups (TorchFT-like)",
}


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise BadJob(f"{name} must be a positive number of seconds, got {value!r}")


def _not_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise BadJob(f"{name} must be 0 or more, got {value!r}")


@dataclass(frozen=True)
class Job:
    """A synchronous data-parallel job: ``ranks`` replicas, one global step
    every ``step_s`` at full size (the global batch is fixed, so fewer ranks
    take proportionally longer), a durable checkpoint every
    ``checkpoint_every`` steps that blocks training for ``checkpoint_write_s``
    and takes ``checkpoint_load_s`` to load, and a replica state of
    ``state_bytes`` (what a joiner fetches from a peer)."""

    ranks: int
    step_s: float
    checkpoint_every: int | None
    checkpoint_write_s: float
    checkpoint_load_s: float
    state_bytes: int
    #: Ranks per replica group (the replica-group system only; 1 = every
    #: rank its own group).
    replica_group: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise BadJob(f"a job needs at least 1 rank, got {self.ranks}")
        _positive("the step time", self.step_s)
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise BadJob(f"the checkpoint interval must be at least 1 step, got "
                         f"{self.checkpoint_every}")  # fmt: skip
        _not_negative("the checkpoint write time", self.checkpoint_write_s)
        _not_negative("the checkpoint load time", self.checkpoint_load_s)
        if self.state_bytes < 0:
            raise BadJob(f"the state size must be 0 or more bytes, got {self.state_bytes}")
        if not 1 <= self.replica_group <= self.ranks:
            raise BadJob(f"a replica group holds 1 to {self.ranks} ranks, got "
                         f"{self.replica_group}")  # fmt: skip

    @property
    def groups(self) -> int:
        return -(-self.ranks // self.replica_group)


@dataclass(frozen=True)
class Host:
    """Where the ranks run. ``cores=None``: every rank has its own device, so
    a job with ``n`` of its ``N`` ranks trains at ``n / N`` of its full rate.
    ``cores=c``: all ranks share ``c`` cores (the benchmark machine), so the
    rate is ``min(n, c) / min(N, c)``: on 2 cores 3 workers train as fast as 4.
    ``replace_after_s``: a rank that is gone (dead, or evicted and exited) is
    replaced by a new process started this long after (a supervisor or a
    spare machine); the new process then needs the system's measured start-up
    time before it joins."""

    cores: int | None = None
    replace_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.cores is not None and self.cores < 1:
            raise BadJob(f"a shared host needs at least 1 core, got {self.cores}")
        _not_negative("the replacement delay", self.replace_after_s)

    def capacity(self, live: int, ranks: int) -> float:
        """Share of the full training rate with ``live`` of ``ranks`` ranks."""
        if live <= 0:
            return 0.0
        if self.cores is None:
            return live / ranks
        return min(live, self.cores) / min(ranks, self.cores)


@dataclass(frozen=True)
class FaultMix:
    """The faults a job meets, per rank: failures at ``failure_rate`` per
    second (exponential lifetimes, so the job's rate is ``ranks`` times
    that), of which ``silent_share`` leave no TCP reset behind (a lost
    machine: only the detector's timeout finds them; the rest are crashes
    that peers notice at once); and transient pauses of healthy ranks at
    ``pauses_per_failure`` times the failure rate, their lengths lognormal
    (median ``pause_median_s``, shape ``pause_sigma``) capped at
    ``pause_max_s``."""

    failure_rate: float
    silent_share: float
    pauses_per_failure: float
    pause_median_s: float
    pause_sigma: float
    pause_max_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.failure_rate) and self.failure_rate > 0):
            raise BadJob(f"the failure rate must be positive, got {self.failure_rate!r}")
        if not 0 <= self.silent_share <= 1:
            raise BadJob(f"the share of silent failures is between 0 and 1, got "
                         f"{self.silent_share!r}")  # fmt: skip
        _not_negative("the pauses per failure", self.pauses_per_failure)
        _positive("the median pause", self.pause_median_s)
        _not_negative("the pause shape (sigma)", self.pause_sigma)
        _positive("the longest pause", self.pause_max_s)

    @property
    def pause_rate(self) -> float:
        return self.failure_rate * self.pauses_per_failure

    def job_mtbf_s(self, ranks: int) -> float:
        """Mean time between failures of the whole job."""
        return 1.0 / (self.failure_rate * ranks)
