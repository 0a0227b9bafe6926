"""A worker's side of the protocol (membership/member.py): unit tests pin one
rule each; a stateful hypothesis machine drives generated interleavings of
the control thread's inputs (views, roll calls, acknowledgements) and the
training thread's (entering, reducing, applying) and checks the invariants:
no step applied after an answer that named the step before it, no abort
lost, nothing done in an epoch older than one answered."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollcall.membership.config import Config
from rollcall.membership.member import Answer, Drop, Fence, Member, ReportFailure
from rollcall.membership.view import Member as ViewMember
from rollcall.membership.view import View

CONFIG = Config()
ME = "w-me"


def view(epoch: int, *ids: str, resume: int | None = 0) -> View:
    return View(epoch, tuple(ViewMember(i, f"{i}:1") for i in ids), resume)


def joined() -> Member:
    member = Member(CONFIG)
    member.joined(ME)
    return member


def test_a_roll_call_aborts_the_step_until_the_view_it_produced_is_entered() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(member.next_view() or view(0))
    assert not member.aborting
    assert member.roll_call(2) == Answer(2, None)
    assert member.aborting
    assert member.next_view() is None  # view 1 is the one being left
    member.view_committed(view(2, ME, "w-b"))
    entering = member.next_view()
    assert entering is not None and entering.epoch == 2
    member.enter(entering)
    assert not member.aborting


def test_what_runs_in_a_view_left_behind_stays_aborted_once_a_newer_view_is_entered() -> None:
    # A group still being built for view 1 polls aborts(1): entering view 2
    # ends the abort of the step in flight, never that of view 1's work.
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    assert not member.aborts(1)
    member.roll_call(2)
    assert member.aborts(1)
    member.view_committed(view(2, ME))
    member.enter(view(2, ME))
    assert not member.aborting and not member.aborts(2)
    assert member.aborts(1)


def training(step: int = 4) -> Member:
    """A member in view 1 that committed ``step``."""
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.restored(step)
    return member


def land(member: Member, step: int, stop: bool = False) -> Answer | None:
    """``step``'s reduction (``stop``: someone asked to stop after it), its
    update and the loop's code after it; the answer released, if any."""
    assert member.reduced(step, epoch=1, stop=stop) is None
    assert member.applied(step, landed=True) is None
    return member.settled()


def test_a_roll_call_for_joiners_aborts_nothing_and_is_answered_after_the_next_step() -> None:
    member = training(4)
    assert member.roll_call(2, at_step_end=True) is None
    assert not member.aborting and member.stop_asked  # step 5 runs on and asks for the stop
    assert land(member, 5, stop=True) == Answer(2, 5)
    assert member.aborting and not member.stop_asked


def test_a_member_that_others_stopped_holds_until_it_is_asked_and_names_the_same_step() -> None:
    member = training(4)
    assert land(member, 5, stop=True) is None  # another member asked in step 5's reduction
    assert member.halted and not member.aborting
    assert member.roll_call(2, at_step_end=True) == Answer(2, 5)
    assert not member.halted and member.aborting


def test_a_member_asked_after_its_contribution_stops_one_step_later_with_everyone() -> None:
    member = training(4)
    assert member.reduced(5, epoch=1, stop=False) is None  # contributed before it was asked
    assert member.roll_call(2, at_step_end=True) is None
    assert member.applied(5, landed=True) is None
    assert member.settled() is None  # nobody asked in step 5: step 6 asks
    assert member.stop_asked
    assert land(member, 6, stop=True) == Answer(2, 6)


def test_a_roll_call_that_cannot_wait_for_the_step_end_aborts_as_any_other() -> None:
    member = training(4)
    member.roll_call(2, at_step_end=True)
    assert member.give_up_step_end() == Answer(2, 4)
    assert member.aborting and not member.stop_asked
    assert member.reduced(5, epoch=1, stop=True) is Drop.ANSWERED
    assert member.give_up_step_end() is None


def test_the_late_timer_of_an_older_roll_call_leaves_a_newer_ones_step_end_wait_alone() -> None:
    """Roll call 2 (a join) waited for step 5's end and was answered; in
    view 2 roll call 3 (a leave) waits for step 6's end. Roll call 2's
    timer (``rollcall_step_end_wait`` after it arrived) firing now must not
    give up roll call 3's wait: step 6 would be aborted and trained again
    without the leaver's part, its work lost."""
    member = training(4)
    assert member.roll_call(2, at_step_end=True) is None
    assert land(member, 5, stop=True) == Answer(2, 5)
    member.view_committed(view(2, ME, "w-1", resume=5))
    member.enter(view(2, ME, "w-1", resume=5))
    assert member.roll_call(3, at_step_end=True) is None
    assert member.give_up_step_end(2) is None  # roll call 2's timer, late
    assert member.stop_asked and not member.aborting  # step 6 runs on
    assert member.give_up_step_end(3) == Answer(3, 5)  # its own timer gives up
    assert member.aborting and not member.stop_asked


def test_a_member_leaving_after_its_step_reduces_it_asking_the_stop_and_applies_nothing() -> None:
    member = training(4)
    member.leave(after_step=True)
    assert not member.aborting and member.stop_asked  # step 5 runs on and asks for the stop
    assert member.reduced(5, epoch=1, stop=True) is Drop.GONE  # its part is in the others' step
    assert member.leaving and member.aborting and member.step == 4


def test_a_member_leaving_after_its_step_can_be_stopped_before_it() -> None:
    member = training(4)
    member.leave(after_step=True)
    member.leave()  # the step took too long
    assert member.aborting
    assert member.reduced(5, epoch=1, stop=True) is Drop.GONE
    member = training(4)
    member.leave()
    member.leave(after_step=True)  # a second signal's wish changes nothing
    assert member.aborting and not member.finishing


def test_a_roll_call_for_joiners_is_answered_at_once_by_a_member_not_training() -> None:
    member = joined()
    assert member.roll_call(1, at_step_end=True) == Answer(1, None)
    member = training(4)
    member.roll_call(2)  # a crash's roll call: aborting now
    assert member.roll_call(3, at_step_end=True) == Answer(3, 4)


def test_a_halted_member_that_is_never_asked_trains_on_after_a_roll_calls_deadline() -> None:
    member = training(4)
    land(member, 5, stop=True)
    member.tick(100.0)
    assert member.halted
    member.tick(100.0 + CONFIG.rollcall_deadline + 0.01)
    assert not member.halted and not member.aborting


def test_a_dropped_stop_step_still_ends_the_wait() -> None:
    member = training(4)
    member.roll_call(2, at_step_end=True)
    assert member.reduced(5, epoch=1, stop=True) is None
    assert member.applied(5, landed=False) == Answer(2, 4)  # no acknowledgement: not landed


def test_a_step_reduced_in_an_epoch_older_than_an_answer_is_dropped() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.roll_call(2)
    assert member.reduced(5, epoch=1) is Drop.ANSWERED
    assert member.applying is None


def test_a_roll_call_during_an_update_is_answered_once_it_landed_and_names_it() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.acked(sent_at=10.0)
    assert member.reduced(7, epoch=1) is None
    assert member.roll_call(2) is None  # waits for the update
    assert member.fence(now=10.1, since=10.1) is Fence.OK
    assert member.applied(7, landed=True) is None  # and then for the loop to finish it
    assert member.settled() == Answer(2, 7)
    assert member.step == 7


def test_a_roll_call_after_a_step_landed_waits_until_the_loop_finished_the_step() -> None:
    # The loop's code after commit() (an EMA update) is part of the step:
    # the state an answer names must include it.
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.acked(sent_at=10.0)
    assert member.reduced(4, epoch=1) is None
    assert member.applied(4, landed=True) is None
    assert member.roll_call(2) is None
    assert member.aborting
    assert member.settled() == Answer(2, 4)
    assert member.settled() is None  # nothing settles twice
    assert member.roll_call(3) == Answer(3, 4)  # settled: answered at once


def test_a_dropped_step_answers_a_waiting_roll_call_at_once() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    assert member.reduced(4, epoch=1) is None
    assert member.roll_call(2) is None
    assert member.applied(4, landed=False) == Answer(2, None)
    assert member.settling is None


def test_without_a_fresh_acknowledgement_the_fence_waits_then_expires() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.acked(sent_at=0.0)
    assert member.reduced(3, epoch=1) is None
    since = CONFIG.fence_window + 0.1
    assert member.fence(now=since, since=since) is Fence.WAIT
    assert member.fence(now=since + CONFIG.fence_patience + 0.1, since=since) is Fence.EXPIRED
    assert member.applied(3, landed=False) is None
    assert member.step == -1


def reduced_step_3(acked_at: float) -> Member:
    """A member of view 1 whose step 3 was reduced, with a heartbeat sent
    at ``acked_at`` acknowledged."""
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.acked(sent_at=acked_at)
    assert member.reduced(3, epoch=1) is None
    return member


def test_a_step_waits_out_a_leader_failover_for_its_acknowledgement_and_lands() -> None:
    # The leader died just after the reduction: acknowledgements stop for
    # the election and a reconnection, much longer than fence_window. A
    # member that gave up would drop a step that members whose last
    # acknowledgement was a little younger landed.
    member = reduced_step_3(acked_at=10.0)
    since = 10.0 + CONFIG.fence_window + 0.05
    failover = CONFIG.election_ttl + CONFIG.session_open_timeout
    assert member.fence(now=since + failover - 0.1, since=since) is Fence.WAIT
    member.acked(sent_at=since + failover - 0.05)  # the new leader acknowledges
    assert member.fence(now=since + failover, since=since) is Fence.OK
    assert member.applied(3, landed=True) is None
    assert member.step == 3


def test_past_its_patience_a_step_waits_while_the_session_is_between_leaders() -> None:
    # The failover outlasts fence_patience (a loaded machine, a slow
    # election, the only replica restarted). Landing stays safe (only an
    # acknowledgement lets a step land); dropping it while the members
    # whose sessions reopened sooner land it would part them.
    member = reduced_step_3(acked_at=10.0)
    since = 10.0 + CONFIG.fence_window + 0.05
    late = since + CONFIG.fence_patience + 60.0
    assert member.fence(now=late, since=since) is Fence.EXPIRED  # a leader is there: cut off
    assert member.fence(now=late, since=since, between_leaders=True) is Fence.WAIT
    member.acked(sent_at=late)  # the next leader acknowledges
    assert member.fence(now=late + 0.1, since=since, between_leaders=False) is Fence.OK
    assert member.applied(3, landed=True) is None
    assert member.step == 3


def test_a_member_leaving_or_evicted_does_not_wait_for_the_next_leader() -> None:
    since = 10.0 + CONFIG.fence_window + 0.05
    late = since + CONFIG.fence_patience + 1.0
    leaving = reduced_step_3(acked_at=10.0)
    leaving.leave(after_step=True)  # SIGTERM while it waits: it leaves, the others land it
    assert leaving.fence(now=since + 1.0, since=since, between_leaders=True) is Fence.WAIT
    assert leaving.fence(now=late, since=since, between_leaders=True) is Fence.EXPIRED
    evicted = reduced_step_3(acked_at=10.0)
    evicted.session_ended()  # the next leader no longer holds it
    assert evicted.fence(now=since, since=since, between_leaders=True) is Fence.EXPIRED


def test_an_evicted_member_does_not_wait_for_an_acknowledgement() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.acked(sent_at=0.0)
    assert member.reduced(3, epoch=1) is None
    member.session_ended()
    assert member.fence(now=CONFIG.fence_window + 0.1, since=CONFIG.fence_window) is Fence.EXPIRED


def test_min_workers_holds_back_a_new_jobs_first_step_only() -> None:
    member = joined()
    member.view_committed(view(1, ME, resume=None))
    assert member.next_view(min_workers=2) is None
    member.view_committed(view(2, ME, "w-b", resume=None))
    assert member.next_view(min_workers=2) == view(2, ME, "w-b", resume=None)
    member.view_committed(view(3, ME, resume=41))  # the job has progress: no wait
    assert member.next_view(min_workers=2) == view(3, ME, resume=41)


def test_a_failure_no_view_change_follows_is_reported_once_after_the_bound() -> None:
    member = joined()
    member.failed(now=1.0, reason="epoch 1: all-reduce failed")
    assert member.tick(now=1.0 + CONFIG.detection_bound()) is None
    assert member.tick(now=1.1 + CONFIG.detection_bound()) == ReportFailure(
        "epoch 1: all-reduce failed"
    )
    assert member.tick(now=9.0 + CONFIG.detection_bound()) is None


def test_an_ended_session_drops_whatever_was_reduced() -> None:
    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.session_ended()
    assert member.aborting
    assert member.reduced(1, epoch=1) is Drop.GONE


# --- the old runtime's abort, for contrast ------------------------------------------


@dataclass
class EventAbort:
    """The runtime before membership/member.py: the control thread set the
    roll-call epoch and then an Event; entering a view read the epoch and
    cleared the Event if the epoch was not newer, as two separate steps."""

    rollcall_epoch: int = 0
    abort: bool = False
    entering: int = 0
    read: int = field(default=0)

    def control_sets_epoch(self, epoch: int) -> None:
        self.rollcall_epoch = max(self.rollcall_epoch, epoch)

    def control_sets_event(self) -> None:
        self.abort = True

    def enter_reads(self, epoch: int) -> None:
        self.entering, self.read = epoch, self.rollcall_epoch

    def enter_clears(self) -> None:
        if self.read <= self.entering:
            self.abort = False


def test_the_interleaving_that_lost_an_abort_loses_none_now() -> None:
    # Entering view 1 reads the roll-call epoch (still 1), a roll call for
    # epoch 2 arrives and sets its flag, then entering clears the flag.
    old = EventAbort()
    old.enter_reads(1)
    old.control_sets_epoch(2)
    old.control_sets_event()
    old.enter_clears()
    assert old.rollcall_epoch > old.entering and not old.abort, "the old way loses it"

    member = joined()
    member.view_committed(view(1, ME))
    member.enter(view(1, ME))
    member.roll_call(2)
    assert member.aborting, "an abort is a comparison of two numbers: nothing to clear"


# --- generated interleavings --------------------------------------------------------


class MemberMachine(RuleBasedStateMachine):
    """The control thread's and the training thread's inputs, interleaved in
    any order; time moves forward only. ``log`` holds what the member did,
    in order: ("answer", roll-call epoch, step named), ("apply", step,
    epoch it ran in) and ("settle", step, epoch): the loop finished the step
    after its commit."""

    def __init__(self) -> None:
        super().__init__()
        self.member = joined()
        self.now = 0.0
        self.epoch = 0  # newest epoch the leader committed
        self.log: list[tuple[str, int, int]] = []
        self.reducing: tuple[int, int] | None = None  # (step, epoch) in the all-reduce
        self.asking = False  # whether that reduction asks for the stop
        self.in_flight: tuple[int, int, float] | None = None  # (step, epoch, fence since)
        self.entered_views: list[int] = []

    def _answered(self, answer: Answer | None) -> None:
        if answer is not None:
            self.log.append(("answer", answer.epoch, -1 if answer.step is None else answer.step))

    # control thread

    @rule(others=st.integers(0, 2), resume=st.booleans())
    def leader_commits_a_view(self, others: int, resume: bool) -> None:
        self.epoch += 1
        ids = [ME, *(f"w-{i}" for i in range(others))]
        step = self.member.step if resume and self.member.step >= 0 else None
        self.member.view_committed(view(self.epoch, *ids, resume=step))

    @rule(at_step_end=st.booleans())
    def leader_calls_a_roll_call(self, at_step_end: bool) -> None:
        """For a crash, or only for joiners (answered after a step's end)."""
        self._answered(self.member.roll_call(self.epoch + 1, at_step_end))

    @rule(older=st.one_of(st.none(), st.integers(0, 2)))
    def a_roll_call_stops_waiting_for_the_step_end(self, older: int | None) -> None:
        """A failed step (None), or the timer of the newest roll call or of
        one ``older`` than it (which gives nothing up)."""
        epoch = None if older is None else self.epoch + 1 - older
        waiting = self.member.ending
        answer = self.member.give_up_step_end(epoch)
        if epoch is not None and epoch != waiting:
            assert answer is None and self.member.ending == waiting  # another's wait: kept
        self._answered(answer)

    @rule(delay=st.floats(0.0, 1.0))
    def leader_acknowledges(self, delay: float) -> None:
        self.member.acked(sent_at=max(0.0, self.now - delay))

    @rule(delay=st.floats(0.0, 0.4))
    def time_passes(self, delay: float) -> None:
        self.now += delay
        self.member.tick(self.now)

    # training thread

    @precondition(
        lambda self: self.in_flight is None and self.reducing is None
        and self.member.settling is None
    )  # fmt: skip
    @rule()
    def training_enters_the_next_view(self) -> None:
        entering = self.member.next_view()
        if entering is not None:
            self.member.enter(entering)
            self.entered_views.append(entering.epoch)

    @precondition(
        lambda self: self.in_flight is None and self.reducing is None and self.member.entered > 0
        and self.member.settling is None
    )  # fmt: skip
    @rule()
    def training_starts_a_reduction(self) -> None:
        # Not while aborting (the step stops before its all-reduce) nor
        # while halted (the loop starts no step).
        if not self.member.aborting and not self.member.halted:
            self.reducing = (self.member.step + 1, self.member.entered)
            self.asking = self.member.stop_asked

    @precondition(lambda self: self.reducing is not None)
    @rule(others_asked=st.booleans())
    def training_completes_a_reduction(self, others_asked: bool) -> None:
        # A roll call may have been answered while the all-reduce ran; any
        # member of the view may have asked for the stop in it.
        assert self.reducing is not None
        step, epoch = self.reducing
        self.reducing = None
        if self.member.reduced(step, epoch, stop=self.asking or others_asked) is None:
            self.in_flight = (step, epoch, self.now)

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def training_checks_the_fence(self) -> None:
        assert self.in_flight is not None
        step, epoch, since = self.in_flight
        verdict = self.member.fence(self.now, since)
        if verdict is Fence.WAIT:
            return
        landed = verdict is Fence.OK
        answer = self.member.applied(step, landed)
        if landed:
            self.log.append(("apply", step, epoch))
        self._answered(answer)
        self.in_flight = None

    @precondition(lambda self: self.member.settling is not None)
    @rule()
    def training_finishes_the_step_after_commit(self) -> None:
        # The loop's own code after commit() changes registered state here.
        self.log.append(("settle", self.member.step, self.member.entered))
        self._answered(self.member.settled())

    # invariants

    @invariant()
    def no_step_is_applied_in_a_view_older_than_a_roll_call_answered_before(self) -> None:
        # Such a step would run twice: the answer named the step before it,
        # and the new view resumes from there.
        newest_answer = 0
        for kind, a, b in self.log:
            if kind == "answer":
                newest_answer = max(newest_answer, a)
            elif kind == "apply":
                assert b >= newest_answer, (
                    f"step {a} applied in epoch {b} after answer {newest_answer}"
                )

    @invariant()
    def every_answer_names_the_last_step_that_landed_before_it(self) -> None:
        last = -1
        for kind, a, b in self.log:
            if kind == "apply":
                last = a
            elif kind == "answer":
                assert b == last, f"answer to roll call {a} named {b}, last landed {last}"

    @invariant()
    def no_answer_comes_between_a_step_landing_and_the_loop_finishing_it(self) -> None:
        unsettled = False
        for kind, a, b in self.log:
            if kind == "apply":
                unsettled = True
            elif kind == "settle":
                unsettled = False
            elif kind == "answer":
                assert not unsettled, f"roll call {a} answered before step {b} was finished"

    @invariant()
    def an_abort_is_never_lost(self) -> None:
        member = self.member
        if member.answered > member.entered:
            assert member.aborting
            assert member.next_view() is None or member.next_view().epoch >= member.answered

    @invariant()
    def a_member_asking_for_the_stop_or_halted_has_not_answered_that_roll_call(self) -> None:
        member = self.member
        if member.ending is not None:
            assert member.ending > member.answered, "a roll call both waiting and answered"
        if member.halted:
            assert not member.aborting and member.ending is None

    @invariant()
    def views_are_entered_in_increasing_epochs_never_older_than_an_answer(self) -> None:
        assert self.entered_views == sorted(set(self.entered_views))


MemberMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40)
test_member_machine = MemberMachine.TestCase
