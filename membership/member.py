"""A worker's side of the protocol as a pure state machine.

The runtime (``worker/runtime.py``) feeds it what happens — a view committed,
a roll call started, a heartbeat acknowledged, a reduction done or failed,
time passing — and does what it decides: answer the roll call, abort the
step in flight, apply or drop a step, ask for a roll call, report a failure,
enter a view. No threads, sockets or clock reads: the runtime passes the
time in and serializes the calls (one lock, held only for a call).

Two monotonic numbers replace every flag: ``answered``, the newest roll call
this member answered, and ``entered``, the newest view it began to enter.
The step in flight is aborted exactly while ``answered > entered``: a roll
call for the next epoch makes that true, entering the view it produced
makes it false again, and nothing is ever cleared, so no abort can be lost
between the thread that answers and the thread that trains.

The rules (DESIGN.md, "Steps, commits and coherent state"; docs/worker.md,
"Fencing"):

* a step whose reduction completed is applied only if no roll call newer
  than its epoch was answered (that answer named the previous step) and the
  leader acknowledged a heartbeat sent within ``fence_window``; it waits up
  to ``fence_patience`` for such an acknowledgement, and past that for as
  long as its session is between leaders (a leader failover stops
  acknowledgements for seconds, longer on a loaded machine: every member
  that completed the reduction waits it out and lands the step, rather
  than some landing it and some not);
* a roll call that arrives while such a step is being applied is answered
  once it has landed, so the answer names it (and every member that
  completed the reduction answers alike);
* a step that landed is *settling* until the loop asks for the next step
  (or declares itself busy): the loop's own code after ``commit()`` (an
  EMA update, a counter) is part of the step, so a roll call that arrives
  meanwhile is answered once it settled, and the state it names is the
  step's whole state;
* a view is entered only if it is newer than any entered, contains this
  member, is not older than a roll call answered, and (while nobody holds
  state) has ``min_workers`` members;
* a failure seen by this member (a peer reset a connection) that no view
  change follows within the detector's bound is reported, once;
* a roll call held only for joiners and clean leaves (``at_step_end``)
  aborts nothing: the member asks, in the next step's reduction, that
  every member of the view stop after that step (``stop_asked``), and
  answers once it has landed;
  a reduction in which any member asked says so to all of them
  (``reduced(..., stop=True)``), so every member stops after the same step
  and names it, whoever was asked first; one that stopped before it was
  asked holds (``halted``: no step starts) until it is. A member that
  cannot reach such a step soon (a long step, a busy period, a failed
  reduction) answers as for any roll call (``give_up_step_end``), aborting
  its step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rollcall.membership.config import Config
from rollcall.membership.view import EMPTY_VIEW, View

__all__ = ["Answer", "Drop", "Fence", "Member", "ReportFailure"]


@dataclass(frozen=True)
class Answer:
    """Decision: answer roll call ``epoch`` naming ``step`` (None: no step
    committed yet)."""

    epoch: int
    step: int | None


@dataclass(frozen=True)
class ReportFailure:
    """Decision: ask for a roll call, naming ``reason``: a failure this member
    saw was followed by no view change."""

    reason: str


class Drop(enum.Enum):
    """Why a step whose reduction completed is not applied."""

    #: A roll call newer than the step's epoch was answered: that answer
    #: named the previous step, so applying this one would run it twice.
    ANSWERED = "a newer roll call was answered"
    #: The session ended (evicted) or the member is leaving.
    GONE = "the member's session ended"
    #: No heartbeat acknowledgement sent within ``fence_window`` arrived in
    #: ``fence_patience`` (and the session was not between leaders): the
    #: member may have been evicted meanwhile; a roll call must realign the
    #: view.
    NO_ACK = "no fresh heartbeat acknowledgement"


class Fence(enum.Enum):
    """Whether a step may be applied now (``Member.fence``)."""

    OK = "apply"
    WAIT = "wait for an acknowledgement"
    EXPIRED = "drop the step and ask for a roll call"


class Member:
    """One worker's protocol state. Every method is called with the
    runtime's lock held; none blocks."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.member_id: str | None = None
        #: Newest committed view received.
        self.view: View = EMPTY_VIEW
        #: Newest roll call answered, and newest view whose entering began.
        self.answered = 0
        self.entered = 0
        #: Last committed step (-1: none).
        self.step = -1
        #: The step being applied (its reduction completed), if any.
        self.applying: int | None = None
        #: The step that landed and whose loop code after commit() runs.
        self.settling: int | None = None
        #: Newest roll call that waits for ``applying`` to land and settle.
        self._deferred: int | None = None
        self.ended = False
        self.leaving = False
        #: Leaving once the step in flight is reduced (``leave(after_step=True)``).
        self.finishing = False
        #: Send time of the newest heartbeat the leader acknowledged.
        self.last_acked = float("-inf")
        #: (when, why) of the first failure seen since the last view change.
        self._failure: tuple[float, str] | None = None
        self._reported = False
        #: The newest roll call to answer at the end of the step in flight
        #: (``roll_call(..., at_step_end=True)``), not answered yet.
        self.ending: int | None = None
        #: The step after which a reduction said the view's members stop.
        self._stop_after: int | None = None
        #: Stopped after such a step before being asked: the loop starts no
        #: step until a roll call is answered (or ``tick`` gives up waiting).
        self.halted = False
        self._halted_since: float | None = None

    # --- what the loop asks ----------------------------------------------------------

    @property
    def aborting(self) -> bool:
        """The step in flight must stop."""
        return self.aborts(self.entered)

    def aborts(self, epoch: int) -> bool:
        """Whatever runs in view ``epoch`` must stop (it is the view entered
        last, or one left behind): a newer roll call was answered, or the
        member is gone."""
        return self.answered > epoch or self.ended or self.leaving

    @property
    def stop_asked(self) -> bool:
        """Whether this member's next reduction asks every member of the
        view to stop after its step (a roll call waits at the step's end,
        or this member leaves after it)."""
        return self.ending is not None or self.finishing

    def next_view(self, min_workers: int = 1) -> View | None:
        """The view to enter now, if any."""
        view = self.view
        if self.member_id is None or self.member_id not in view:
            return None
        if view.epoch <= self.entered or self.answered > view.epoch:
            return None
        if view.resume_step is None and view.size < min_workers and not _resumes_lost(view):
            return None
        return view

    # --- inputs from the control thread -----------------------------------------------

    def joined(self, member_id: str) -> None:
        self.member_id = member_id

    def view_committed(self, view: View) -> None:
        if view.epoch > self.view.epoch:
            self.view = view

    def roll_call(self, epoch: int, at_step_end: bool = False) -> Answer | None:
        """Roll call ``epoch`` started: abort the step in flight. The answer
        now, or None if a step is being applied or settling (``applied`` or
        ``settled`` returns it). ``at_step_end`` (held only for joiners and
        clean leaves): a
        member training in its view aborts nothing and asks for a stop
        instead (``stop_asked``); it answers once the step it stops after
        has landed and settled, None until then."""
        if at_step_end and self._training() and not self.halted:
            self.ending = max(self.ending or 0, epoch)
            return None
        return self._answer_now(epoch)

    def give_up_step_end(self, epoch: int | None = None) -> Answer | None:
        """A roll call waiting for the end of a step waits no more (the step
        is long, or failed): answered as any roll call, aborting the step in
        flight. Its answer now, or None if a step is being applied or
        settling (as ``roll_call``); None also if none is waiting.
        ``epoch``: only if roll call ``epoch`` is the one waiting (its own
        ``rollcall_step_end_wait`` ran out); a newer one that replaced it
        waits for its own time (None: whichever waits, the step failed)."""
        if self.ending is None or (epoch is not None and self.ending != epoch):
            return None
        epoch, self.ending = self.ending, None
        return self._answer_now(epoch)

    def _training(self) -> bool:
        """In a view it entered, with nothing stopping its steps."""
        return self.entered > 0 and not self.aborting

    def _answer_now(self, epoch: int) -> Answer | None:
        self.answered = max(self.answered, epoch)
        self.halted = False
        self._halted_since = None
        if self.ending is not None and self.ending <= epoch:
            self.ending = None
        if self.applying is not None or self.settling is not None:
            self._deferred = max(self._deferred or 0, epoch)
            return None
        return Answer(epoch, self.step if self.step >= 0 else None)

    def acked(self, sent_at: float) -> None:
        self.last_acked = max(self.last_acked, sent_at)

    def session_ended(self) -> None:
        self.ended = True

    def leave(self, after_step: bool = False) -> None:
        """The worker is leaving (a signal, or closing): stop the step.
        ``after_step``: not yet; the step in flight runs on to its
        reduction, which asks the view's members to stop after it, and then
        the member leaves without applying it (``reduced``): its part is in
        the others' step, which they land (a clean leave wastes none of
        their work). ``leave()`` stops it whenever called."""
        if after_step and not self.leaving:
            self.finishing = True
        else:
            self.leaving = True

    # --- inputs from the training thread ----------------------------------------------

    def enter(self, view: View) -> None:
        """The training thread begins entering ``view`` (a ``next_view``)."""
        if view.epoch <= self.entered:
            raise ValueError(f"view {view.epoch} is not newer than {self.entered}")
        self.entered = view.epoch
        self._failure = None
        self._reported = False

    def restored(self, step: int) -> None:
        """The state of committed step ``step`` was loaded (fetched from a
        peer, or from a checkpoint), or dropped (-1)."""
        self.step = step

    def reduced(self, step: int, epoch: int, stop: bool = False) -> Drop | None:
        """The reduction of ``step`` in view ``epoch`` completed; ``stop``:
        a member asked in it that the view's members stop after this step.
        None: go on (``fence`` then ``applied``); else why it must be
        dropped."""
        if self.finishing:
            self.leaving = True
        if self.ended or self.leaving:
            return Drop.GONE
        if self.answered > epoch:
            return Drop.ANSWERED
        self.applying = step
        if stop:
            self._stop_after = step
        return None

    def fence(self, now: float, since: float, between_leaders: bool = False) -> Fence:
        """May the step being applied land? Only with an acknowledgement of
        a heartbeat sent within ``fence_window``; ``since``: when the fence
        check began. It waits ``fence_patience`` for one, and past that as
        long as the member's session is ``between_leaders``
        (``RendezvousClient.between_leaders``: its next answer is a
        leader's, an acknowledgement or its end), unless it is leaving."""
        if self.ended or self.leaving:
            return Fence.EXPIRED
        if now - self.last_acked <= self._config.fence_window:
            return Fence.OK
        if now - since <= self._config.fence_patience:
            return Fence.WAIT
        return Fence.WAIT if between_leaders and not self.finishing else Fence.EXPIRED

    def applied(self, step: int, landed: bool) -> Answer | None:
        """The step being applied landed (``landed``: it settles next) or was
        dropped. Returns the answer of a roll call that waited for a dropped
        step (one that waited for a landed step waits for ``settled``)."""
        if self.applying != step:
            raise ValueError(f"step {step} is not being applied ({self.applying})")
        self.applying = None
        if landed:
            self.step = step
            self.settling = step
            return None
        if self._stop_after == step:
            # Dropped (no acknowledgement): the others stop after it anyway.
            self._stop_after = None
            return self._stopped() or self._release()
        return self._release()

    def settled(self) -> Answer | None:
        """The loop finished the step that landed last (it asks for the next
        step, leaves the loop or declares itself busy). Returns the answer of
        a roll call that waited for it."""
        if self.settling is None:
            return None
        stopping = self._stop_after == self.settling
        self.settling = None
        if stopping:
            self._stop_after = None
            return self._stopped() or self._release()
        return self._release()

    def _stopped(self) -> Answer | None:
        """The step the view's members stop after is done: answer the roll
        call that asked for it, or hold until it comes."""
        if self.ending is not None:
            return self._answer_now(self.ending)
        if not self.aborting:  # (a roll call answered meanwhile ends the view anyway)
            self.halted = True
        return None

    def _release(self) -> Answer | None:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return None
        return Answer(deferred, self.step if self.step >= 0 else None)

    def failed(self, now: float, reason: str) -> None:
        """A collective or a peer call failed; a roll call normally follows."""
        if self._failure is None:
            self._failure = (now, reason)

    def tick(self, now: float) -> ReportFailure | None:
        """Time passes while no view is entered, or while halted: report a
        failure that no view change followed within the detector's bound
        (once). A member halted for longer than a roll call's deadline
        without being asked (the roll call was dropped: the leader failed,
        say) trains on in its view."""
        if self.halted:
            if self._halted_since is None:
                self._halted_since = now
            elif now - self._halted_since > self._config.rollcall_deadline:
                self.halted = False
                self._halted_since = None
        failure = self._failure
        if failure is None or self._reported:
            return None
        if now - failure[0] <= self._config.detection_bound():
            return None
        self._reported = True
        return ReportFailure(failure[1])


def _resumes_lost(view: View) -> bool:
    """A view that resumes a sharded job from its checkpoint because
    partitions were lost: the job is not starting, ``min_workers`` does not
    hold it back."""
    return view.shards is not None and bool(view.shards.lost)
