"""Whether etcd still holds the history a replica has seen of it.

etcd is the job's only durable truth, but it can lose it: a data directory
wiped or replaced, a cluster rebuilt, a restore from an old backup. Then it
answers as if the job were new (no view, epoch 0) or older than it is, and
a replica that believed it would fence every live worker as "ahead of the
committed epoch". Every replica therefore remembers the highest position
it has seen (etcd's cluster id, its revision, the job's view epoch) and
checks each new observation against it: a changed cluster id, a revision
or an epoch going backwards means the data was lost. Pure code: the
positions come from etcd's response headers, read by the caller.

Only reads that follow one another can be compared: a replica's reads run
in several threads, so an answer etcd gave before one already judged can
come back after it (seen: a standby's poll, answered at revision 2, judged
after its own takeover read at revision 3, said "etcd lost the job's
data"). Each read therefore takes a ``ticket`` before it is sent; its
answer is ``stale`` when something newer was seen after that ticket, and
is then neither judged nor remembered (the next read is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Continuity", "EtcdPosition"]


@dataclass(frozen=True)
class EtcdPosition:
    """What one etcd answer says about its history."""

    #: etcd's cluster id (response header): a new cluster has a new one.
    cluster_id: int
    #: etcd's revision when it answered (response header).
    revision: int
    #: The job's committed view epoch etcd holds (0: no view).
    epoch: int


@dataclass
class Continuity:
    """The highest position one replica has seen, and the check of a new one."""

    cluster_id: int | None = None
    revision: int = 0
    epoch: int = 0
    #: Counts tickets and raised marks, in the order they happened.
    _clock: int = field(default=0, repr=False)
    #: The clock when the mark last changed.
    _raised: int = field(default=0, repr=False)

    def ticket(self) -> int:
        """Taken just before a read is sent; given to ``stale`` with its answer."""
        self._clock += 1
        return self._clock

    def stale(self, ticket: int) -> bool:
        """Whether the answer to the read sent at ``ticket`` may be older
        than something seen since (it cannot be judged against it)."""
        return ticket < self._raised

    def _mark(self, cluster_id: int | None, revision: int, epoch: int) -> None:
        if (cluster_id, revision, epoch) != (self.cluster_id, self.revision, self.epoch):
            self.cluster_id, self.revision, self.epoch = cluster_id, revision, epoch
            self._clock += 1
            self._raised = self._clock

    def lost(self, seen: EtcdPosition) -> str | None:
        """Why ``seen`` cannot follow what was seen before (etcd lost the
        job's data), or None if it can."""
        if self.cluster_id is not None and seen.cluster_id != self.cluster_id:
            return f"etcd's cluster id changed from {self.cluster_id:x} to {seen.cluster_id:x}"
        if seen.epoch < self.epoch:
            held = f"epoch {seen.epoch}" if seen.epoch else "no view"
            return f"etcd holds {held} of the job, and this replica saw epoch {self.epoch}"
        if seen.revision < self.revision:
            return f"etcd's revision went from {self.revision} back to {seen.revision}"
        return None

    def advance(self, seen: EtcdPosition) -> None:
        """Record ``seen`` (a position that ``lost`` accepted)."""
        self._mark(seen.cluster_id, max(self.revision, seen.revision), max(self.epoch, seen.epoch))

    def rebase(self, seen: EtcdPosition) -> None:
        """Start again from ``seen`` after the job's record was restored in
        an etcd that had lost it (the epoch seen stays: it was restored)."""
        self._mark(seen.cluster_id, seen.revision, max(self.epoch, seen.epoch))

    def saw_epoch(self, epoch: int) -> None:
        """A view of ``epoch`` was committed or observed (by any means)."""
        self._mark(self.cluster_id, self.revision, max(self.epoch, epoch))
