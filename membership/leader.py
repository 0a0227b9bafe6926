"""The leader replica's policy as a pure state machine.

``Leader`` owns the roll-call ``Coordinator`` and the ``FailureDetector`` of
one job while this replica leads it, and decides what only the leader
decides: whom to suspect (a broken session stream, the detector, a joiner
that never opened a session, a member of the inherited view that neither
reconnected within the takeover grace nor answers at its address), whose
etcd lease to keep alive, when a member's busy period ends and which
progress to write. The I/O shell (``rollcall.rendezvous``) feeds it what
happened and when (sessions opened and ended, heartbeats, answers,
progress, reports, commits, the results of its etcd calls, ``tick(now)``)
and carries out the actions it emits (``take_actions``). It reads no clock
and opens no socket.

Eviction needs evidence about the member (DESIGN.md, Trust): nothing etcd
does or fails to do (a lease that expired, a record that vanished, an etcd
that does not answer) is an input that can suspect anyone. And the
leader's own lag is not evidence either: when the shell woke up late
(``woke``), heartbeats may be waiting unread in its own queues, so the
detector's suspicions wait one more round.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollcall.membership.cause import Cause
from rollcall.membership.config import Config
from rollcall.membership.coordinator import (
    CommitView,
    Coordinator,
    ReportOutcome,
    RequestAnswers,
)
from rollcall.membership.detector import FailureDetector
from rollcall.membership.view import Member, View


class Evidence(enum.Enum):
    """What the leader saw of a member it suspects."""

    #: Its session stream broke (process killed, connection cut): the
    #: fastest failure signal there is.
    STREAM_BROKEN = "session stream broken"
    #: Silent for longer than the heartbeat detector allows.
    DETECTOR = "heartbeat detector"
    #: Joined but opened no session within ``join_session_timeout``.
    NO_SESSION = "joined but never opened a session"
    #: On a shared session, its holder heard nothing from it for longer
    #: than the earliest suspicion (a host agent's own detector).
    SILENT_ON_CARRIER = "silent, as the holder of its shared session saw it"
    #: A member of the inherited view that did not reconnect within the
    #: takeover grace, and whose process does not answer at its address.
    ABSENT = "did not reconnect after leader failover, and nothing answers at"


@dataclass(frozen=True)
class Evict:
    """Action: take ``member_id`` off the leader's books: end its session
    and remove its etcd record. ``cause`` is why: ``Cause.leave`` (it left:
    the session ends cleanly), ``Cause.suspect`` (with the ``evidence``), or
    None (it lost its place in view ``epoch``)."""

    member_id: str
    cause: Cause | None
    epoch: int
    evidence: Evidence | None = None
    #: Where nothing answered (``Evidence.ABSENT``).
    address: str = ""
    #: How long the member had been silent when it was suspected.
    silence_s: float = 0.0
    #: Whether the suspicion is news to the coordinator (a roll call drops
    #: or will remove the member); a member already on its way out is not.
    counted: bool = False

    @property
    def reason(self) -> str:
        """The evidence in words (empty unless suspected)."""
        if self.evidence is None:
            return ""
        if self.evidence is Evidence.ABSENT:
            return f"{self.evidence.value} {self.address}"
        return self.evidence.value


@dataclass(frozen=True)
class PeerBusy:
    """Action: tell every other member that ``member_id`` is busy for
    ``seconds`` (0: no longer busy), so their collectives wait for it.
    ``overran``: the period ended by itself, the member never ended it."""

    member_id: str
    seconds: float
    reason: str
    overran: bool = False


@dataclass(frozen=True)
class WriteProgress:
    """Action: record in etcd that view ``epoch`` got to ``step``."""

    epoch: int
    step: int


@dataclass(frozen=True)
class KeepLeasesAlive:
    """The members whose etcd leases are kept alive this round."""

    member_ids: tuple[str, ...]


Action = RequestAnswers | CommitView | Evict | PeerBusy | WriteProgress


class Leader:
    """The policy of the leader replica of one job, from its takeover on."""

    def __init__(
        self, config: Config, view: View, now: float, joiners: Sequence[Member] = ()
    ) -> None:
        """Take over ``view`` (as etcd holds it) with ``joiners`` (members
        recorded but not in it). No roll call starts until every member of
        the view reconnected or was found dead: calling a member that
        cannot be asked yet would evict it for the change of leader, not for
        anything it did. A member whose record vanished is not suspected for
        it (records expire whenever etcd cannot keep their leases alive):
        every member of the view gets the takeover grace to reconnect."""
        self._config = config
        self.coordinator = Coordinator(config, view, now, awaiting=view.ids)
        for member in joiners:  # asked once they reconnect
            self.coordinator.join(member, now, ready=False)
        self.detector = FailureDetector(config)
        self.detector.set_interval(config.heartbeat_interval_for(view.size))
        #: Until when members of the inherited view keep their leases unasked.
        self.grace_until = now + config.takeover_grace if view.members else now
        self._join_deadlines = {j.id: now + config.join_session_timeout for j in joiners}
        self._sessions: set[str] = set()
        #: Members whose session is on a shared stream, and that stream's
        #: key (``session_opened(carrier=...)``); the members on each
        #: stream open here. The detector watches such a stream, not them.
        self._carrier_of: dict[str, str] = {}
        self._riders: dict[str, set[str]] = {}
        #: Members that declared themselves busy: member id -> (until, reason).
        self._busy: dict[str, tuple[float, str]] = {}
        #: Members of the inherited view that did not reconnect within the
        #: takeover grace but whose process answers.
        self._held_elsewhere: set[str] = set()
        self._lagging = False
        self._next_suspicion: float | None = None
        #: The highest step a member of the view in force reported committing.
        self._step: int | None = None
        #: Whether the job has trained (a resume step, or a reported step).
        self._trained = view.resume_step is not None
        self._step_written: tuple[int, int] | None = None
        self._actions: list[Action] = []

    # --- read-only state -----------------------------------------------------

    @property
    def view(self) -> View:
        """The last committed view."""
        return self.coordinator.view

    @property
    def step(self) -> int | None:
        """The last step committed in the view in force, as its members
        reported it (its resume step until they do)."""
        return self._step

    @property
    def trained(self) -> bool:
        """Whether the job has any progress this leader knows of."""
        return self._trained

    @property
    def step_written(self) -> tuple[int, int] | None:
        """The ``(epoch, step)`` last recorded in etcd by this leader."""
        return self._step_written

    @property
    def busy(self) -> Mapping[str, tuple[float, str]]:
        """Busy members: member id -> (until, reason)."""
        return self._busy

    @property
    def pace(self) -> float:
        """The heartbeat interval members are told: ``Config.
        heartbeat_interval_for`` the view in force's size, or the sessions
        open at its commit if they were more (joiners)."""
        return self.detector.interval

    @property
    def lagging(self) -> bool:
        """Whether detector suspicions are deferred for the leader's own lag."""
        return self._lagging

    def has_session(self, member_id: str) -> bool:
        return member_id in self._sessions

    def knows(self, member_id: str) -> bool:
        """Members of the view, pending joiners and roll-call candidates."""
        return self.coordinator.knows(member_id)

    def next_wakeup(self, now: float) -> float | None:
        """Absolute time at which ``tick`` has work to do, if any."""
        wakeups = [
            t
            for t in (
                self.coordinator.next_wakeup(),
                self._next_suspicion,
                self.grace_until if self.grace_until > now else None,
                *self._join_deadlines.values(),
                *(until for until, _ in self._busy.values()),
            )
            if t is not None
        ]
        return min(wakeups, default=None)

    def take_actions(self) -> list[Action]:
        """Actions emitted since the last call, in order."""
        self._pull()
        actions, self._actions = self._actions, []
        return actions

    # --- members and their sessions --------------------------------------------

    def joined(self, member: Member, now: float) -> None:
        """A new member was recorded in etcd: it enters with the first roll
        call after it opened its session, if it does so within
        ``join_session_timeout``."""
        self._join_deadlines[member.id] = now + self._config.join_session_timeout
        self.coordinator.join(member, now, ready=False)
        self._pull()

    def session_opened(self, member_id: str, now: float, carrier: str | None = None) -> None:
        """A member opened its session (or reconnected); its silence is
        counted from now. On a shared stream (``carrier``, opened with
        ``carrier_opened``) the stream's heartbeats stand for it."""
        self._unride(member_id)
        self._sessions.add(member_id)
        self._join_deadlines.pop(member_id, None)
        if carrier is None:
            self.detector.watch(member_id, now)
        else:
            self.detector.forget(member_id)
            self._carrier_of[member_id] = carrier
            self._riders[carrier].add(member_id)
            self.detector.heartbeat(carrier, now)  # the Open came on it: it is alive
        if self.coordinator.is_awaited(member_id):
            self._held_elsewhere.discard(member_id)
            self.coordinator.reconnected(member_id, now)
            self._pull()
        elif self.coordinator.is_unready(member_id):
            self.coordinator.joiner_ready(member_id, now)
            self._pull()

    def session_rejected(self, member_id: str, now: float) -> None:
        """A member's session ended on a message this leader refused: that
        changes nothing else (it may reconnect; if it stays silent the
        detector, still watching it, suspects it). A member of a shared
        stream is watched on its own from then on, silent since the
        stream's last heartbeat."""
        self._sessions.discard(member_id)
        carrier = self._unride(member_id)
        if carrier is not None and carrier in self.detector:
            self.detector.watch(member_id, now - self.detector.silence(carrier, now))

    # --- shared sessions ---------------------------------------------------------

    def carrier_opened(self, key: str, now: float) -> None:
        """A shared session stream opened (docs/protocol.md, "Shared
        sessions"): the detector watches it under ``key`` (which no member
        id can be), and its heartbeats stand for every member on it."""
        self._riders[key] = set()
        self.detector.watch(key, now)

    def carrier_heard(self, key: str, now: float) -> None:
        """A heartbeat of shared stream ``key``."""
        self.detector.heartbeat(key, now)

    def carrier_ended(self, key: str, now: float, broken: bool) -> None:
        """Shared stream ``key`` ended: it broke (``broken``: every member
        still on it is suspected, as its own stream breaking would be), or
        on a message this leader refused (each member's session was
        rejected: ``session_rejected``)."""
        riders = sorted(self._riders.get(key, ()))
        for member_id in riders:
            if broken:
                self.suspect(member_id, Evidence.STREAM_BROKEN, now)
            else:
                self.session_rejected(member_id, now)
        self._riders.pop(key, None)
        self.detector.forget(key)

    def carried_closed(self, member_id: str, silent: bool, now: float) -> None:
        """The holder of a shared stream took ``member_id`` off it
        (``Close``): its process ended (as if its own stream broke) or the
        holder heard nothing from it (``silent``). Either way it is
        suspected if it is still in the job."""
        if silent:
            self.suspect(member_id, Evidence.SILENT_ON_CARRIER, now)
        else:
            self.suspect(member_id, Evidence.STREAM_BROKEN, now)

    def session_broken(self, member_id: str, now: float) -> None:
        """A member's session stream broke."""
        self.suspect(member_id, Evidence.STREAM_BROKEN, now)

    def heard(self, member_id: str, now: float) -> None:
        """Any message from ``member_id`` counts as a heartbeat (of its
        shared stream, if it is on one)."""
        self.detector.heartbeat(self._carrier_of.get(member_id, member_id), now)

    def leave(self, member_id: str, now: float) -> None:
        """A member leaves cleanly."""
        self.coordinator.leave(member_id, now)
        self._remove(Evict(member_id, Cause.leave(member_id), self.view.epoch))
        self._pull()

    def suspect(self, member_id: str, evidence: Evidence, now: float, address: str = "") -> None:
        """Remove ``member_id`` from the roll for ``evidence``."""
        counted = self.coordinator.suspect(member_id, now)
        silence = self.detector.silence(self._carrier_of.get(member_id, member_id), now)
        self._remove(
            Evict(member_id, Cause.suspect(member_id), self.view.epoch, evidence, address,
                  silence, counted)
        )  # fmt: skip
        self._pull()

    def probed(self, member: Member, answers: bool, now: float) -> bool:
        """The process of ``member``, awaited since the takeover grace
        ended, was probed at its address. One that answers is alive, most
        likely still held by the previous leader, cut off from etcd: it is
        not evicted and roll calls wait for it (returns True the first time
        it is found so). One that does not answer is suspected, unless it
        reconnected meanwhile."""
        if answers:
            if member.id in self._held_elsewhere:
                return False
            self._held_elsewhere.add(member.id)
            return True
        if self.coordinator.is_awaited(member.id) and member.id not in self._sessions:
            self.suspect(member.id, Evidence.ABSENT, now, member.address)
        return False

    def absent(self) -> tuple[str, ...]:
        """Members of the inherited view to probe once the takeover grace
        is over: those awaited that have no session (sorted)."""
        return tuple(sorted(m for m in self.coordinator.awaiting if m not in self._sessions))

    def declare_busy(self, member_id: str, seconds: float, reason: str, now: float) -> None:
        """Record (or, with 0 seconds, end) a member's busy period."""
        self.heard(member_id, now)
        self._busy_for(member_id, seconds, reason, now, overran=False)

    # --- the roll call ---------------------------------------------------------

    def answer(
        self, member_id: str, epoch: int, step: int | None, digest: str, now: float,
        shard_epoch: int | None = None, unsettled: bool = False,
    ) -> None:  # fmt: skip
        """A candidate answers roll call ``epoch`` (``Coordinator.answer``'s
        errors pass through: the answer changed nothing)."""
        self.heard(member_id, now)
        try:
            self.coordinator.answer(member_id, epoch, step, digest, now, shard_epoch, unsettled)
        finally:
            self._pull()

    def report(self, reporter: str, member_id: str, now: float) -> ReportOutcome:
        """Member ``reporter`` reports ``member_id`` failing in the view in
        force (``Coordinator.report``)."""
        outcome = self.coordinator.report(reporter, member_id, now)
        self._pull()
        return outcome

    def progress(self, member_id: str, epoch: int, step: int, now: float) -> int | None:
        """A member committed ``step`` in view ``epoch``. Returns the view
        in force's step (``step``) if the report counts (a member of the
        view in force, at its epoch), else None."""
        self.heard(member_id, now)
        self.coordinator.progress(member_id, epoch, step)
        view = self.view
        if epoch != view.epoch or member_id not in view:
            return None
        self._step = max(step, self._step if self._step is not None else step)
        self._trained = True
        return self._step

    def committed(self, view: View, now: float) -> None:
        """The proposal was committed in etcd. The old view's last step is
        recorded now: if every worker is gone, it is the step a resumed job
        has to reach again. Members that lost their place are removed."""
        proposal = self.coordinator.proposal
        old, step = self.view, self._step
        self.coordinator.committed(view, now)  # NotProposed changes nothing
        if step is not None and (old.epoch, step) != self._step_written:
            self._emit(WriteProgress(old.epoch, step))
        self._step = view.resume_step
        self._trained = self._trained or self._step is not None
        self.detector.set_interval(self._config.heartbeat_interval_for(self.heartbeating()))
        for member_id in proposal.removed if proposal is not None else ():
            self._remove(Evict(member_id, None, view.epoch))
        self._pull()

    # --- time and etcd ---------------------------------------------------------

    def tick(self, now: float) -> None:
        """Let time pass: the coordinator's deadlines, busy periods that ran
        out, the detector's suspicions (only when one may be due: scanning
        costs O(members), and heartbeats only ever push suspicion later;
        never while the leader lags) and joiners that never opened a
        session."""
        self.coordinator.tick(now)
        for member_id, (until, _) in list(self._busy.items()):
            if now >= until:
                self._busy_for(member_id, 0.0, "", now, overran=True)
        if not self._lagging and self._next_suspicion is not None and now >= self._next_suspicion:
            for watched in self.detector.suspects(now):
                riders = self._riders.get(watched)
                if riders is None:
                    if watched not in self._busy:
                        self.suspect(watched, Evidence.DETECTOR, now)
                    continue
                # A silent shared stream: every member on it is silent.
                for member_id in sorted(riders):
                    if member_id not in self._busy:
                        self.suspect(member_id, Evidence.DETECTOR, now)
                # What is left on it is busy (or nothing): its silence is
                # counted again from now, as a busy member's would be.
                self.detector.watch(watched, now)
            self._next_suspicion = None
        for member_id, deadline in list(self._join_deadlines.items()):
            if now >= deadline and member_id not in self._sessions:
                self.suspect(member_id, Evidence.NO_SESSION, now)
        if self._next_suspicion is None:
            self._next_suspicion = self.detector.next_scan(now)
        self._pull()

    def woke(self, now: float, planned: float | None) -> float | None:
        """The shell's wait ended: on an event (``planned`` None), or by
        itself at ``now`` when it meant to wake at ``planned``. Waking more
        than a heartbeat interval late defers the detector's suspicions by
        one round (not two in a row). Returns the lateness when it does."""
        if planned is None:
            self._lagging = False
            return None
        late = now - planned
        self._lagging = late > self._config.heartbeat_interval and not self._lagging
        return late if self._lagging else None

    def leases(self, recorded: Iterable[str], now: float) -> KeepLeasesAlive:
        """Which of the ``recorded`` members' leases to keep alive: while
        the member's session is healthy (or it declared itself busy), and
        for a grace period after a takeover or a join (before it connects)."""
        return KeepLeasesAlive(tuple(m for m in recorded if self._lease_deserved(m, now)))

    def progress_due(self) -> WriteProgress | None:
        """The view in force's last step, if it is not recorded yet."""
        epoch = self.view.epoch
        if self._step is None or (epoch, self._step) == self._step_written:
            return None
        return WriteProgress(epoch, self._step)

    def progress_for_checkpoint(self, step: int) -> WriteProgress | None:
        """The progress record is never more than one step behind the
        newest recorded checkpoint (a resuming worker checks manifests
        against it): the reported step, if the record is further behind
        than a checkpoint of ``step`` allows. Never raised on the
        checkpoint's word alone."""
        written = self._step_written
        if written is not None and written[1] >= step - 1:
            return None
        if self._step is None or (written is not None and self._step <= written[1]):
            return None
        return WriteProgress(self.view.epoch, self._step)

    def progress_written(self, epoch: int, step: int) -> None:
        """etcd recorded that view ``epoch`` got to ``step``."""
        self._step_written = (epoch, step)

    # --- internals -------------------------------------------------------------

    def heartbeating(self) -> int:
        """Who heartbeats to this leader: each member's own session, each
        shared stream (for all its members), and the members of the view
        that have no session here yet (they will open one). Joiners in
        session count too: in a burst of joins they outnumber the view."""
        own = len(self._sessions) - len(self._carrier_of)
        waiting = sum(1 for member_id in self.view.ids if member_id not in self._sessions)
        return own + len(self._riders) + waiting

    def _lease_deserved(self, member_id: str, now: float) -> bool:
        watched = self._carrier_of.get(member_id, member_id)
        if member_id in self._sessions and watched in self.detector:
            return member_id in self._busy or not self.detector.suspected(watched, now)
        if member_id in self._join_deadlines:
            return now < self._join_deadlines[member_id]
        return now < self.grace_until or self.coordinator.is_awaited(member_id)

    def _busy_for(
        self, member_id: str, seconds: float, reason: str, now: float, *, overran: bool
    ) -> None:
        if seconds > 0:
            self._busy[member_id] = (now + seconds, reason)
        elif self._busy.pop(member_id, None) is not None:
            # Its heartbeats may have been starved meanwhile: silence is
            # counted from now on, not from before the busy period (a
            # shared stream's own heartbeats went on).
            if member_id not in self._carrier_of:
                self.detector.watch(member_id, now)
        else:
            return
        self._emit(PeerBusy(member_id, seconds, reason, overran))

    def _unride(self, member_id: str) -> str | None:
        """Take ``member_id`` off the shared stream it is on; returns that
        stream's key (None: it is on none)."""
        carrier = self._carrier_of.pop(member_id, None)
        if carrier is not None:
            self._riders.get(carrier, set()).discard(member_id)
        return carrier

    def _remove(self, evict: Evict) -> None:
        """The one way a member leaves the leader's books."""
        member_id = evict.member_id
        self._unride(member_id)
        self.detector.forget(member_id)
        self._join_deadlines.pop(member_id, None)
        self._busy.pop(member_id, None)
        self._sessions.discard(member_id)
        self._emit(evict)

    def _emit(self, action: Action) -> None:
        self._actions.append(action)

    def _pull(self) -> None:
        """The coordinator's actions, after this machine's own of the same
        event (a removal goes before the roll call it causes)."""
        self._actions.extend(self.coordinator.take_actions())
