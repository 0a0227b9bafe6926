"""The roll-call state machine: events in, actions out, time passed in.

Unit tests pin one behaviour each; the state machine at the end drives
generated event sequences and checks the invariants of the committed views.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Mapping
from random import Random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rollcall.membership.cause import Cause, CauseKind
from rollcall.membership.config import Config
from rollcall.membership.coordinator import (
    Action,
    Answer,
    CommitView,
    Coordinator,
    Refusal,
    RefusedClaim,
    ReportOutcome,
    RequestAnswers,
    plan_resume,
)
from rollcall.membership.errors import InvalidRequest, NotAMember, NotProposed, StaleEpoch
from rollcall.membership.view import EMPTY_VIEW, Member, View

CONFIG = Config()
SETTLE = CONFIG.join_settle
DEADLINE = CONFIG.rollcall_deadline
#: The deadline of a roll call held at the step's end (joins, clean leaves):
#: an answer may come that much later (``rollcall_step_end_wait``).
HELD = CONFIG.rollcall_step_end_wait + DEADLINE


def worker(member_id: str) -> Member:
    return Member(member_id, f"{member_id}.example:29500")


def established(*member_ids: str, epoch: int = 1) -> Coordinator:
    """A coordinator whose committed view holds ``member_ids`` and nothing is pending."""
    return Coordinator(CONFIG, View(epoch, tuple(worker(i) for i in member_ids)), now=0.0)


def only_commit(actions: list[Action]) -> CommitView:
    commits = [a for a in actions if isinstance(a, CommitView)]
    assert len(commits) == 1, actions
    return commits[0]


def answer_missing(
    coordinator: Coordinator, now: float, step: int | None = None, digest: str = ""
) -> None:
    rollcall = coordinator.rollcall
    assert rollcall is not None
    for member_id in rollcall.missing:
        coordinator.answer(member_id, rollcall.epoch, step, digest, now)


def commit(coordinator: Coordinator, now: float) -> View:
    """Drain the actions, confirm the single proposed view and return it."""
    view = only_commit(coordinator.take_actions()).view
    coordinator.committed(view, now)
    return view


def rollcall_over(coordinator: Coordinator, member_id: str, now: float) -> int:
    """Start a roll call by a join of ``member_id`` and return its epoch."""
    coordinator.join(worker(member_id), now)
    coordinator.tick(now + SETTLE)
    rollcall = coordinator.rollcall
    assert rollcall is not None
    coordinator.take_actions()
    return rollcall.epoch


def snapshot(coordinator: Coordinator) -> tuple[Any, ...]:
    """Everything a caller can observe of the coordinator."""
    return (
        coordinator.view,
        copy.deepcopy(coordinator.rollcall),
        coordinator.proposal,
        coordinator.pending_joiners,
        coordinator.next_wakeup(),
    )


# --- joins -------------------------------------------------------------------


def test_first_join_waits_for_join_settle() -> None:
    coordinator = Coordinator(CONFIG, EMPTY_VIEW, now=0.0)

    coordinator.join(worker("a"), 0.0)
    coordinator.tick(SETTLE * 0.99)

    assert coordinator.take_actions() == []
    assert coordinator.rollcall is None


def test_first_join_makes_epoch_1_after_settle() -> None:
    coordinator = Coordinator(CONFIG, EMPTY_VIEW, now=0.0)
    coordinator.join(worker("a"), 0.0)

    coordinator.tick(SETTLE)
    assert coordinator.take_actions() == [RequestAnswers(1, ("a",))]
    coordinator.answer("a", 1, None, "", SETTLE)
    proposal = only_commit(coordinator.take_actions())
    coordinator.committed(proposal.view, SETTLE)

    assert proposal == CommitView(
        view=View(1, (worker("a"),)), previous=EMPTY_VIEW, removed=(), causes=(Cause.join("a"),)
    )
    assert coordinator.view == View(1, (worker("a"),))


def test_burst_of_joins_within_settle_makes_one_view_in_arrival_order() -> None:
    coordinator = Coordinator(CONFIG, EMPTY_VIEW, now=0.0)
    arrivals = [f"w{(i * 7) % 16:02d}" for i in range(16)]

    for i, member_id in enumerate(arrivals):
        coordinator.join(worker(member_id), i * SETTLE / 20)
    assert coordinator.take_actions() == []
    coordinator.tick(SETTLE)
    [request] = coordinator.take_actions()
    answer_missing(coordinator, SETTLE)
    view = commit(coordinator, SETTLE)

    assert request == RequestAnswers(1, tuple(arrivals))
    assert view.epoch == 1
    assert view.ids == tuple(arrivals)
    assert coordinator.take_actions() == []
    assert coordinator.next_wakeup() is None


def test_join_during_a_rollcall_waits_for_the_next_one() -> None:
    coordinator = established("a", "b")
    coordinator.leave("b", 0.0)
    coordinator.take_actions()

    coordinator.join(worker("c"), 0.1)
    rollcall = coordinator.rollcall
    assert rollcall is not None and rollcall.missing == ("a",)
    coordinator.answer("a", 2, None, "", 0.2)
    assert commit(coordinator, 0.2).ids == ("a",)

    assert coordinator.take_actions() == [RequestAnswers(3, ("a", "c"))]


def test_candidates_are_view_members_in_view_order_then_joiners_in_arrival_order() -> None:
    coordinator = established("c", "a", "b")

    coordinator.join(worker("z"), 0.0)
    coordinator.join(worker("y"), 0.01)
    coordinator.tick(SETTLE)

    assert coordinator.take_actions() == [RequestAnswers(2, ("c", "a", "b", "z", "y"))]


def test_joiners_given_to_the_constructor_are_pending() -> None:
    coordinator = Coordinator(CONFIG, EMPTY_VIEW, now=3.0, joiners=[worker("a"), worker("b")])

    assert coordinator.pending_joiners == (worker("a"), worker("b"))
    assert coordinator.next_wakeup() == 3.0 + SETTLE


@pytest.mark.parametrize("where", ["view", "pending joiner", "candidate", "proposal"])
def test_join_with_an_id_already_known_is_rejected(where: str) -> None:
    coordinator = established("a")
    if where == "pending joiner":
        coordinator.join(worker("b"), 0.0)
    elif where in ("candidate", "proposal"):
        rollcall_over(coordinator, "b", 0.0)
        if where == "proposal":
            answer_missing(coordinator, 0.1)
    coordinator.take_actions()
    before = snapshot(coordinator)

    with pytest.raises(InvalidRequest):
        coordinator.join(worker("a" if where == "view" else "b"), 0.1)

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


def test_join_during_a_pending_commit_is_deferred_to_the_next_rollcall() -> None:
    coordinator = established("a")
    rollcall_over(coordinator, "b", 0.0)
    answer_missing(coordinator, 0.1)
    proposal = only_commit(coordinator.take_actions())

    coordinator.join(worker("c"), 0.2)
    coordinator.tick(5.0)
    assert coordinator.take_actions() == []
    assert coordinator.rollcall is None
    coordinator.committed(proposal.view, 5.0)

    assert proposal.view.ids == ("a", "b")
    assert coordinator.take_actions() == [RequestAnswers(3, ("a", "b", "c"))]


# --- leaves and suspicions -----------------------------------------------------


@pytest.mark.parametrize("depart", ["leave", "suspect"])
def test_departure_starts_a_rollcall_at_once(depart: str) -> None:
    coordinator = established("a", "b", "c")

    assert getattr(coordinator, depart)("b", 5.0) is True

    assert coordinator.take_actions() == [RequestAnswers(2, ("a", "c"))]
    assert coordinator.next_wakeup() == 5.0 + (HELD if depart == "leave" else DEADLINE)


@pytest.mark.parametrize("depart", ["leave", "suspect"])
def test_departed_member_is_removed_from_the_next_view(depart: str) -> None:
    coordinator = established("a", "b", "c")
    getattr(coordinator, depart)("b", 0.0)
    coordinator.take_actions()

    answer_missing(coordinator, 0.1)
    proposal = only_commit(coordinator.take_actions())

    assert proposal.view.ids == ("a", "c")
    assert proposal.removed == ("b",)
    assert proposal.causes == (Cause(CauseKind(depart), "b"),)


@pytest.mark.parametrize(
    ("events", "waits"),
    [
        (("join",), True),
        (("leave",), True),
        (("join", "leave"), True),
        (("suspect",), False),
        (("join", "suspect"), False),
        (("join", "recheck"), False),
    ],
)
def test_a_roll_call_for_joins_and_clean_leaves_only_waits_for_the_step_end(
    events: tuple[str, ...], waits: bool
) -> None:
    """``at_step_end``: a joiner takes no part in the step in flight, and a
    member that left cleanly took part in it or closed its connections;
    a suspect or a reported member may never answer in it. (A join waits
    ``join_settle``, so the roll call a departure starts at once carries
    it too.)"""
    coordinator = established("a", "b", "c")
    for event in events:
        if event == "join":
            coordinator.join(worker("d"), 0.0)
        elif event == "recheck":
            coordinator.recheck("b", Cause.report("b", "a"), 0.0)
        else:
            getattr(coordinator, event)("c" if event == "leave" else "b", 0.0)
    coordinator.tick(SETTLE)
    rollcall = coordinator.rollcall
    assert rollcall is not None
    assert sorted(c.kind.value for c in rollcall.causes) == sorted(
        "report" if e == "recheck" else e for e in events
    )
    assert rollcall.at_step_end is waits


def test_departure_during_a_rollcall_removes_the_candidate_from_it() -> None:
    coordinator = established("a", "b", "c", "d")
    coordinator.suspect("d", 0.0)
    coordinator.take_actions()
    coordinator.answer("a", 2, 4, "d4", 0.1)
    coordinator.answer("b", 2, 5, "d5", 0.1)

    coordinator.leave("b", 0.2)
    rollcall = coordinator.rollcall
    assert rollcall is not None and [c.id for c in rollcall.candidates] == ["a", "c"]
    coordinator.answer("c", 2, 4, "d4", 0.3)
    proposal = only_commit(coordinator.take_actions())

    assert proposal.view.ids == ("a", "c")
    assert proposal.view.resume_step == 4
    assert proposal.removed == ("b", "d")
    assert proposal.causes == (Cause.suspect("d"), Cause.leave("b"))


def test_last_silent_candidate_leaving_completes_the_rollcall_at_once() -> None:
    coordinator = established("a", "b")
    rollcall_over(coordinator, "c", 0.0)
    coordinator.answer("a", 2, None, "", 0.1)
    coordinator.answer("c", 2, None, "", 0.1)

    coordinator.suspect("b", 0.2)

    assert only_commit(coordinator.take_actions()).view.ids == ("a", "c")
    assert coordinator.rollcall is None


def test_members_that_left_cleanly_no_longer_count_while_the_view_without_them_commits() -> None:
    """``staying``: what fingerprint admission counts as the job's members."""
    coordinator = established("a", "b", "c", "d")
    coordinator.leave("a", 0.0)  # a roll call starts at once
    assert coordinator.rollcall is not None
    assert (coordinator.view.size, coordinator.staying) == (4, 3)

    coordinator.suspect("b", 0.1)  # may be alive: still counts
    assert coordinator.staying == 3

    answer_missing(coordinator, 0.2)  # proposed, not committed yet
    coordinator.leave("c", 0.3)  # in the proposed view: departs with the next roll call
    assert (coordinator.view.size, coordinator.staying) == (4, 2)

    commit(coordinator, 0.4)
    assert coordinator.view.ids == ("c", "d")
    assert coordinator.staying == 1
    answer_missing(coordinator, 0.5)
    commit(coordinator, 0.5)
    assert (coordinator.view.ids, coordinator.staying) == (("d",), 1)


def test_a_job_whose_only_member_left_has_none_staying_before_the_empty_view_commits() -> None:
    coordinator = established("a")
    coordinator.leave("a", 0.0)
    assert (coordinator.view.size, coordinator.staying) == (1, 0)
    assert commit(coordinator, 0.0).size == 0
    assert coordinator.staying == 0


def test_pending_joiner_that_leaves_is_not_called() -> None:
    coordinator = established("a")
    coordinator.join(worker("b"), 0.0)
    coordinator.join(worker("c"), 0.0)

    assert coordinator.leave("b", 0.01) is True
    coordinator.tick(SETTLE)

    assert coordinator.take_actions() == [RequestAnswers(2, ("a", "c"))]


def test_a_joiner_that_cannot_be_asked_yet_starts_no_roll_call_and_is_not_called() -> None:
    coordinator = established("a", "b")
    coordinator.join(worker("j"), 0.0, ready=False)
    coordinator.tick(SETTLE)
    assert coordinator.take_actions() == []

    coordinator.leave("b", 0.1)  # a roll call for another cause
    assert coordinator.take_actions() == [RequestAnswers(2, ("a",))]
    answer_missing(coordinator, 0.1)
    view = commit(coordinator, 0.1)

    assert view.ids == ("a",)
    assert coordinator.is_unready("j") and coordinator.knows("j")


def test_a_joiner_enters_the_first_roll_call_after_it_is_ready() -> None:
    coordinator = established("a")
    coordinator.join(worker("j"), 0.0, ready=False)
    coordinator.join(worker("k"), 0.0, ready=False)

    coordinator.joiner_ready("k", 5.0)
    coordinator.tick(5.0 + SETTLE)

    assert coordinator.take_actions() == [RequestAnswers(2, ("a", "k"))]
    assert coordinator.rollcall is not None
    assert coordinator.rollcall.causes == (Cause.join("k"),)
    assert coordinator.is_unready("j")


def test_a_joiner_that_leaves_before_it_is_ready_starts_no_roll_call() -> None:
    coordinator = established("a")
    coordinator.join(worker("j"), 0.0, ready=False)

    assert coordinator.leave("j", 1.0) is True
    coordinator.joiner_ready("j", 1.0)
    coordinator.tick(1.0 + SETTLE)

    assert coordinator.take_actions() == []
    assert not coordinator.knows("j")


def test_join_withdrawn_before_settle_starts_no_rollcall() -> None:
    coordinator = established("a")
    coordinator.join(worker("b"), 0.0)

    assert coordinator.leave("b", 0.01) is True
    coordinator.tick(SETTLE)

    assert coordinator.take_actions() == []
    assert coordinator.next_wakeup() is None


def test_withdrawn_join_is_not_a_cause_of_the_rollcall() -> None:
    coordinator = established("a")
    coordinator.join(worker("b"), 0.0)
    coordinator.join(worker("c"), 0.0)
    coordinator.leave("b", 0.01)
    coordinator.tick(SETTLE)

    rollcall = coordinator.rollcall
    assert rollcall is not None and rollcall.causes == (Cause.join("c"),)


def test_suspect_of_a_member_of_the_uncommitted_view_starts_another_rollcall_after_commit() -> None:
    coordinator = established("a", "b")
    rollcall_over(coordinator, "c", 0.0)
    answer_missing(coordinator, 0.1)
    proposal = only_commit(coordinator.take_actions())

    assert coordinator.suspect("c", 0.2) is True
    assert coordinator.take_actions() == []
    coordinator.committed(proposal.view, 0.3)
    assert coordinator.take_actions() == [RequestAnswers(3, ("a", "b"))]
    answer_missing(coordinator, 0.4)
    following = only_commit(coordinator.take_actions())

    assert proposal.view.ids == ("a", "b", "c")
    assert following.view == View(3, (worker("a"), worker("b")))
    assert following.removed == ("c",)
    assert following.causes == (Cause.suspect("c"),)


def test_suspect_of_a_member_the_uncommitted_view_drops_starts_no_rollcall() -> None:
    coordinator = established("a", "b")
    coordinator.suspect("b", 0.0)
    coordinator.take_actions()
    answer_missing(coordinator, 0.1)
    proposal = only_commit(coordinator.take_actions())

    coordinator.suspect("b", 0.2)
    coordinator.committed(proposal.view, 0.3)

    assert coordinator.take_actions() == []
    assert coordinator.next_wakeup() is None


def test_recheck_starts_a_rollcall_at_once_that_still_calls_the_member() -> None:
    coordinator = established("a", "b")

    assert coordinator.recheck("b", Cause.report("b", "a"), 1.0) is True

    assert coordinator.take_actions() == [RequestAnswers(2, ("a", "b"))]


def test_recheck_of_a_non_member_returns_false_and_changes_nothing() -> None:
    coordinator = established("a")
    before = snapshot(coordinator)

    assert coordinator.recheck("nobody", Cause.report("nobody", "a"), 1.0) is False

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


def report_until_limited(coordinator: Coordinator, reporter: str, now: float) -> int:
    """Reports by ``reporter`` naming ``b``, each roll call committed with
    everyone answering, until one is refused; returns how many were held."""
    held = 0
    while True:
        outcome = coordinator.report(reporter, "b", now)
        if outcome is not ReportOutcome.ROLL_CALL:
            assert outcome is ReportOutcome.LIMITED
            return held
        held += 1
        answer_missing(coordinator, now)
        commit(coordinator, now)


def test_a_members_reports_start_report_burst_roll_calls_then_are_limited() -> None:
    coordinator = established("a", "b")

    assert report_until_limited(coordinator, "a", 0.0) == CONFIG.report_burst
    epoch = coordinator.view.epoch
    assert coordinator.report("a", "b", 0.0) is ReportOutcome.STILL_LIMITED
    assert coordinator.rollcall is None and coordinator.take_actions() == []
    assert coordinator.view.epoch == epoch


def test_a_limited_member_gets_one_roll_call_per_report_interval() -> None:
    coordinator = established("a", "b")
    report_until_limited(coordinator, "a", 0.0)

    later = CONFIG.report_interval
    assert coordinator.report("a", "b", later) is ReportOutcome.ROLL_CALL


def test_the_limit_is_per_member() -> None:
    coordinator = established("a", "b", "c")
    report_until_limited(coordinator, "a", 0.0)

    assert coordinator.report("c", "b", 0.0) is ReportOutcome.ROLL_CALL


def test_a_report_that_needs_no_roll_call_costs_nothing() -> None:
    coordinator = established("a", "b")
    rollcall_over(coordinator, "c", 0.0)  # a view change is under way

    for _ in range(10 * CONFIG.report_burst):
        assert coordinator.report("a", "b", 0.0) is ReportOutcome.NOT_NEEDED
        assert coordinator.report("a", "ghost", 0.0) is ReportOutcome.NOT_NEEDED
    answer_missing(coordinator, 0.1)
    commit(coordinator, 0.1)

    assert report_until_limited(coordinator, "a", 0.2) == CONFIG.report_burst


def test_a_report_naming_the_reporter_itself_counts_against_its_limit() -> None:
    coordinator = established("a", "b")
    for _ in range(CONFIG.report_burst):
        assert coordinator.report("a", "a", 0.0) is ReportOutcome.ROLL_CALL
        answer_missing(coordinator, 0.0)
        commit(coordinator, 0.0)

    assert coordinator.report("a", "b", 0.0) is ReportOutcome.LIMITED


@pytest.mark.parametrize("depart", ["leave", "suspect"])
def test_departure_of_an_unknown_id_returns_false_and_changes_nothing(depart: str) -> None:
    coordinator = established("a")
    before = snapshot(coordinator)

    assert getattr(coordinator, depart)("nobody", 0.0) is False

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


def test_everybody_leaving_gives_an_empty_view() -> None:
    coordinator = established("a", "b")

    coordinator.leave("a", 0.0)
    coordinator.leave("b", 0.1)
    proposal = only_commit(coordinator.take_actions())
    coordinator.committed(proposal.view, 0.1)

    assert proposal.view == View(2, ())
    assert proposal.removed == ("a", "b")
    assert coordinator.view == View(2, ())
    assert coordinator.next_wakeup() is None


# --- the deadline ------------------------------------------------------------


def test_silent_candidate_is_out_at_the_deadline() -> None:
    """A join's roll call is held at the step's end: its deadline is
    ``rollcall_step_end_wait`` later than another's."""
    coordinator = established("a", "b", "c")
    rollcall_over(coordinator, "d", 0.0)
    for member_id in ("a", "b", "d"):
        coordinator.answer(member_id, 2, None, "", 0.1)

    coordinator.tick(SETTLE + DEADLINE)
    coordinator.tick(SETTLE + HELD * 0.99)
    assert coordinator.take_actions() == []
    coordinator.tick(SETTLE + HELD)
    proposal = only_commit(coordinator.take_actions())

    assert proposal.view.ids == ("a", "b", "d")
    assert proposal.removed == ("c",)


def test_silent_joiner_is_out_at_the_deadline_and_listed_as_removed() -> None:
    coordinator = established("a")
    rollcall_over(coordinator, "b", 0.0)
    coordinator.answer("a", 2, None, "", 0.1)

    coordinator.tick(SETTLE + HELD)
    proposal = only_commit(coordinator.take_actions())

    assert proposal.view.ids == ("a",)
    assert proposal.removed == ("b",)


def test_rollcall_is_decided_as_soon_as_every_candidate_answered() -> None:
    coordinator = established("a", "b")
    rollcall_over(coordinator, "c", 0.0)

    coordinator.answer("a", 2, None, "", 0.1)
    coordinator.answer("b", 2, None, "", 0.1)
    assert coordinator.take_actions() == []
    coordinator.answer("c", 2, None, "", 0.2)

    assert only_commit(coordinator.take_actions()).view.ids == ("a", "b", "c")
    assert coordinator.rollcall is None
    assert coordinator.next_wakeup() is None


# --- resume step, digest and fetch plan ------------------------------------------


def decide(answers: Mapping[str, tuple[int | None, str]]) -> View:
    """The view a roll call over ``answers``' ids (in that order) produces."""
    coordinator = established(*answers)
    rollcall_over(coordinator, "trigger", 0.0)
    coordinator.leave("trigger", SETTLE)
    for member_id, (step, digest) in answers.items():
        coordinator.answer(member_id, 2, step, digest, SETTLE)
    return only_commit(coordinator.take_actions()).view


def test_view_resumes_from_the_highest_committed_step_among_answers() -> None:
    view = decide({"a": (10, "d10"), "b": (11, "d11"), "c": (11, "d11")})

    assert view.resume_step == 11
    assert view.digest == "d11"


def test_member_behind_fetches_from_every_holder_of_the_resume_step() -> None:
    view = decide({"a": (10, "d10"), "b": (11, "d11"), "c": (11, "d11")})

    assert view.fetch == {"a": ("b", "c")}


def test_joiner_without_a_step_fetches_from_the_holders() -> None:
    view = decide({"a": (3, "d"), "b": (3, "d"), "new": (None, "")})

    assert view.fetch == {"new": ("a", "b")}


def test_member_with_a_minority_digest_fetches_from_the_majority() -> None:
    view = decide({"a": (7, "x"), "b": (7, "y"), "c": (7, "y")})

    assert view.digest == "y"
    assert view.fetch == {"a": ("b", "c")}


def test_digest_tie_goes_to_the_most_senior_holder() -> None:
    """Every replica decides alike, and a newer member's digest never wins
    a tie against an older one's (a smallest-digest rule could be won by
    grinding a state until its digest sorts first)."""
    view = decide({"a": (7, "y"), "b": (7, "x"), "c": (6, "x")})

    assert view.digest == "y"
    assert view.fetch == {"b": ("a",), "c": ("a",)}


def test_decision_does_not_depend_on_the_order_answers_arrive_in() -> None:
    answers = {"a": (7, "y"), "b": (7, "x"), "c": (6, "x"), "d": (None, "")}
    views = set()
    for order in itertools.permutations(answers):
        coordinator = established(*answers)
        rollcall_over(coordinator, "e", 0.0)
        coordinator.leave("e", SETTLE)
        for member_id in order:
            step, digest = answers[member_id]
            coordinator.answer(member_id, 2, step, digest, SETTLE)
        views.add(only_commit(coordinator.take_actions()).view.to_json())

    assert len(views) == 1


def test_no_committed_step_means_no_resume_step_and_nothing_to_fetch() -> None:
    view = decide({"a": (None, ""), "b": (None, "")})

    assert view.resume_step is None
    assert view.digest == ""
    assert view.fetch == {}


# --- holders that answered before their loop's code ran ---------------------------


def answered_unsettled(
    answers: Mapping[str, tuple[int | None, str, bool]],
) -> tuple[Coordinator, CommitView]:
    """View 1 of a, b, c resumed step 9; d joins; each candidate answers
    roll call 2 with (step, digest, unsettled)."""
    coordinator = Coordinator(CONFIG, View(1, tuple(worker(i) for i in "abc"), resume_step=9),
                              now=0.0)  # fmt: skip
    epoch = rollcall_over(coordinator, "d", 0.0)
    for member_id, (step, digest, unsettled) in answers.items():
        coordinator.answer(member_id, epoch, step, digest, 1.0, unsettled=unsettled)
    return coordinator, only_commit(coordinator.take_actions())


def test_no_one_takes_the_state_of_holders_that_answered_before_their_loops_code_ran() -> None:
    """a and b landed step 10 and answered before their loops' code after
    that commit() ran (a sharded step whose all-gather failed): the state
    they serve lacks what that code changes in registered state. The
    joiner d is put off to the next roll call (not evicted), and c, which
    missed step 10 and would fetch it, is left out: it would train on with
    registered state that missed a step's update."""
    coordinator, proposal = answered_unsettled(
        {"a": (10, "x", True), "b": (10, "x", True), "c": (9, "w", False), "d": (None, "", False)}
    )

    assert proposal.view.ids == ("a", "b") and proposal.view.resume_step == 10
    assert proposal.view.fetch == {}
    assert proposal.unsettled == ("a", "b") and proposal.put_off == ("c", "d")
    assert proposal.removed == ("c",), "the joiner put off keeps its place in the queue"
    assert Cause.join("d") not in proposal.causes, "d did not join in this view"

    assert [m.id for m in coordinator.pending_joiners] == ["d"]
    # Called again a roll call's deadline after the decision (at 1.0): by
    # then the loops' code should have run.
    coordinator.committed(proposal.view, 1.5)
    assert coordinator.rollcall is None and coordinator.next_wakeup() == 1.0 + DEADLINE
    coordinator.tick(1.0 + DEADLINE)
    rollcall = coordinator.rollcall
    assert rollcall is not None and [c.id for c in rollcall.candidates] == ["a", "b", "d"]
    coordinator.take_actions()
    for member_id in ("a", "b"):
        coordinator.answer(member_id, rollcall.epoch, 11, "y", 3.0)
    coordinator.answer("d", rollcall.epoch, None, "", 3.0)
    view = only_commit(coordinator.take_actions()).view
    assert view.ids == ("a", "b", "d") and view.fetch == {"d": ("a", "b")}


def test_joiners_put_off_again_and_again_wait_twice_as_long_each_time() -> None:
    """A loop whose code after commit() runs for long (or a member that
    keeps answering unsettled) must not make a view change every second:
    each roll call that puts the joins off again waits twice as long, up to
    32 roll-call deadlines, and one that admits them starts the count anew."""
    coordinator, proposal = answered_unsettled(
        {"a": (10, "x", True), "b": (10, "x", True), "c": (10, "x", True), "d": (None, "", False)}
    )
    now, waits = 1.0, []
    for _ in range(7):
        assert proposal.put_off == ("d",)
        coordinator.committed(proposal.view, now)
        wakeup = coordinator.next_wakeup()
        assert wakeup is not None
        waits.append(wakeup - now)
        now = wakeup
        coordinator.tick(now)
        rollcall = coordinator.rollcall
        assert rollcall is not None
        coordinator.take_actions()
        for member_id in "abc":
            coordinator.answer(member_id, rollcall.epoch, 10, "x", now, unsettled=True)
        coordinator.answer("d", rollcall.epoch, None, "", now)
        proposal = only_commit(coordinator.take_actions())
    assert waits == [DEADLINE * f for f in (1, 2, 4, 8, 16, 32, 32)]


def test_holders_that_answered_before_their_loops_code_ran_keep_their_own_states() -> None:
    """Two holders of the resume step with other digests, one unsettled:
    neither takes the other's state (the settled one's registered state
    already has the step's update, the other's loop is about to make it;
    the sharded step's completion makes their parameters alike)."""
    _, proposal = answered_unsettled(
        {"a": (10, "x", True), "b": (10, "z", False), "c": (10, "x", True), "d": (None, "", False)}
    )

    assert proposal.view.ids == ("a", "b", "c") and proposal.view.fetch == {}
    assert proposal.put_off == ("d",) and proposal.removed == ()


def test_unsettled_answers_of_members_behind_the_resume_step_change_nothing() -> None:
    """Only the holders of the resume step serve state: a member one step
    behind that answered unsettled fetches from them as usual."""
    _, proposal = answered_unsettled(
        {"a": (10, "x", False), "b": (10, "x", False), "c": (9, "w", True), "d": (None, "", False)}
    )

    assert proposal.view.ids == ("a", "b", "c", "d") and proposal.put_off == ()
    assert proposal.view.fetch == {"c": ("a", "b"), "d": ("a", "b")}


# --- answers are claims -------------------------------------------------------------


def decide_after(
    previous: View,
    answers: Mapping[str, tuple[int | None, str]],
    reports: Mapping[str, int] | None = None,
) -> CommitView:
    """The proposal of a roll call after ``previous`` in which every member
    of ``previous`` and every other id of ``answers`` (joiners) answers as
    given, the members of ``previous`` having reported ``reports``."""
    coordinator = Coordinator(CONFIG, previous, now=0.0)
    for member_id, step in (reports or {}).items():
        coordinator.progress(member_id, previous.epoch, step)
    joiners = [i for i in answers if i not in previous]
    for joiner in joiners:
        coordinator.join(worker(joiner), 0.0)
    if not joiners:
        coordinator.recheck(previous.ids[0], Cause.report(previous.ids[0], "a peer"), 0.0)
    coordinator.tick(SETTLE)
    for member_id, (step, digest) in answers.items():
        coordinator.answer(member_id, previous.epoch + 1, step, digest, SETTLE)
    return only_commit(coordinator.take_actions())


def view_of(*member_ids: str, resume: int | None = None) -> View:
    return View(3, tuple(worker(i) for i in member_ids), resume, "d" if resume else "")


def test_a_joiners_claimed_step_is_never_adopted() -> None:
    """Finding 9: a joiner answering step = real + 5000 with the digest of
    an all-zero model became the only source of every member's state."""
    proposal = decide_after(
        view_of("a", "b", resume=10),
        {"a": (20, "d20"), "b": (20, "d20"), "evil": (5020, "zero")},
    )

    assert proposal.view.resume_step == 20 and proposal.view.digest == "d20"
    assert proposal.view.fetch == {"evil": ("a", "b")}
    assert proposal.refused == (RefusedClaim("evil", 5020, Refusal.JOINER),)


def test_a_joiner_never_becomes_a_source_even_when_nobody_else_holds_state() -> None:
    proposal = decide_after(view_of("a"), {"a": (None, ""), "evil": (7, "x")})

    assert proposal.view.resume_step is None and proposal.view.fetch == {}
    assert [c.member_id for c in proposal.refused] == ["evil"]


def test_a_survivor_more_than_one_step_ahead_of_the_others_is_not_believed() -> None:
    proposal = decide_after(
        view_of("a", "b", "c", resume=10), {"a": (30, "d"), "b": (30, "d"), "c": (32, "zero")}
    )

    assert proposal.view.resume_step == 30
    assert proposal.view.fetch == {"c": ("a", "b")}
    assert proposal.refused == (RefusedClaim("c", 32, Refusal.AHEAD, 30),)


def test_a_survivor_one_step_ahead_of_the_others_is_believed() -> None:
    """An all-reduce that completed on some ranks only: those hold one step
    more, and the view resumes from it."""
    proposal = decide_after(view_of("a", "b", resume=10), {"a": (30, "d30"), "b": (31, "d31")})

    assert proposal.view.resume_step == 31
    assert proposal.view.fetch == {"a": ("b",)}
    assert proposal.refused == ()


def test_a_lone_survivor_is_believed_up_to_one_step_past_its_own_reports() -> None:
    """Nobody else can vouch for a member that trained alone: its own
    progress reports are the job's record (a worker reports the step it
    answers with just before the answer)."""
    believed = decide_after(view_of("a", resume=10), {"a": (501, "d"), "j": (None, "")},
                            reports={"a": 500})  # fmt: skip
    refused = decide_after(view_of("a", resume=10), {"a": (600, "d"), "j": (None, "")},
                           reports={"a": 500})  # fmt: skip

    assert believed.view.resume_step == 501 and believed.view.fetch == {"j": ("a",)}
    assert refused.view.resume_step is None
    assert refused.refused == (RefusedClaim("a", 600, Refusal.AHEAD, 500),)


def test_a_survivor_without_reports_is_held_to_the_views_resume_step() -> None:
    assert decide_after(view_of("a", resume=10), {"a": (11, "d")}).view.resume_step == 11
    assert decide_after(view_of("a", resume=10), {"a": (12, "d")}).view.resume_step is None


def test_the_others_answers_not_their_stale_reports_vouch_for_a_survivor() -> None:
    """Progress reports are at most one per heartbeat interval, so another
    member's may lag its answer by several steps: with other survivors
    answering, their answers count, not the reports."""
    proposal = decide_after(
        view_of("a", "b", resume=10), {"a": (40, "d"), "b": (40, "d")}, reports={"a": 33, "b": 36}
    )

    assert proposal.view.resume_step == 40 and proposal.refused == ()


def test_a_job_with_no_recorded_progress_believes_its_survivors() -> None:
    proposal = decide_after(view_of("a", "b"), {"a": (4, "d"), "b": (None, "")})

    assert proposal.view.resume_step == 4 and proposal.view.fetch == {"b": ("a",)}


def test_a_worker_resumed_from_a_checkpoint_is_believed() -> None:
    """A worker alone in a view without state loads the job's newest
    checkpoint and asks for a roll call: its step is the job's."""
    with_report = decide_after(view_of("w"), {"w": (299, "ckpt")}, reports={"w": 299})
    without = decide_after(view_of("w"), {"w": (299, "ckpt")})

    assert with_report.view.resume_step == without.view.resume_step == 299


def test_only_reports_of_the_view_in_force_by_its_members_count() -> None:
    coordinator = Coordinator(CONFIG, view_of("a", resume=10), now=0.0)
    coordinator.progress("a", 2, 500)  # an older view
    coordinator.progress("stranger", 3, 500)
    coordinator.recheck("a", Cause.report("a", "a"), 0.0)
    coordinator.answer("a", 4, 500, "d", 0.0)

    proposal = only_commit(coordinator.take_actions())

    assert proposal.view.resume_step is None
    assert proposal.refused == (RefusedClaim("a", 500, Refusal.AHEAD, 10),)


def test_reports_are_forgotten_when_the_next_view_is_committed() -> None:
    coordinator = Coordinator(CONFIG, view_of("a", resume=10), now=0.0)
    coordinator.progress("a", 3, 500)
    coordinator.recheck("a", Cause.report("a", "a"), 0.0)
    coordinator.answer("a", 4, 11, "d", 0.0)
    commit(coordinator, 0.0)
    coordinator.recheck("a", Cause.report("a", "a"), 0.0)
    coordinator.answer("a", 5, 500, "d", 0.0)

    assert only_commit(coordinator.take_actions()).view.resume_step is None


HONEST_STEPS = st.integers(0, 3)


@settings(max_examples=300, deadline=None)
@given(
    survivors=st.dictionaries(
        st.sampled_from("abcdef"),
        st.tuples(st.none() | HONEST_STEPS, st.sampled_from(["x", "y"])),
        min_size=1,
    ),
    resume=st.none() | HONEST_STEPS,
    claim=st.tuples(st.none() | st.integers(0, 10_000), st.sampled_from(["x", "zero"])),
)
def test_a_joiner_changes_nothing_about_what_the_survivors_resume_from(
    survivors: dict[str, tuple[int | None, str]],
    resume: int | None,
    claim: tuple[int | None, str],
) -> None:
    order = sorted(survivors)
    answers = {i: Answer(i, *survivors[i]) for i in order}
    alone = plan_resume(order, answers, survivors=order, resume=resume)

    joined = plan_resume(
        [*order, "evil"], {**answers, "evil": Answer("evil", *claim)}, survivors=order,
        resume=resume,
    )  # fmt: skip

    assert (joined.step, joined.digest) == (alone.step, alone.digest)
    assert {i: f for i, f in joined.fetch.items() if i != "evil"} == alone.fetch
    if alone.step is not None:
        assert joined.fetch["evil"] == tuple(i for i in order if i not in alone.fetch)


@settings(max_examples=300, deadline=None)
@given(
    honest=st.lists(st.sampled_from([0, 1]), min_size=1, max_size=5),
    base=st.integers(0, 1000),
    lie=st.integers(0, 10_000),
    liar_first=st.booleans(),
)
def test_one_lying_survivor_cannot_move_the_job_more_than_one_step(
    honest: list[int], base: int, lie: int, liar_first: bool
) -> None:
    """Honest survivors hold the same step or one less; one liar claims
    anything with a state of its own: the view never resumes more than one
    step past the honest members' newest, and from the liar alone only if
    its claim is within that step."""
    honest_ids = [f"h{n}" for n in range(len(honest))]
    order = ["liar", *honest_ids] if liar_first else [*honest_ids, "liar"]
    answers = {i: Answer(i, base + s, f"d{base + s}") for i, s in zip(honest_ids, honest,
                                                                       strict=True)}  # fmt: skip
    answers["liar"] = Answer("liar", lie, "zero")
    newest = base + max(honest)

    plan = plan_resume(order, answers, survivors=order, resume=base)

    assert plan.step is not None and plan.step <= newest + 1
    sources = {i for i in order if i not in plan.fetch}
    if lie > newest + 1:
        assert "liar" not in sources and plan.step == newest


def test_answer_of_a_candidate_that_then_departs_does_not_count() -> None:
    coordinator = established("a", "b", "c")
    rollcall_over(coordinator, "d", 0.0)
    coordinator.answer("c", 2, 9, "ahead", 0.1)

    coordinator.suspect("c", 0.1)
    answer_missing(coordinator, 0.2, step=8, digest="d8")
    view = only_commit(coordinator.take_actions()).view

    assert view.resume_step == 8
    assert view.digest == "d8"
    assert view.fetch == {"d": ("a", "b")}, "the joiner's own claim is not adopted"


def test_latest_answer_of_a_candidate_counts() -> None:
    coordinator = established("a", "b")
    rollcall_over(coordinator, "c", 0.0)
    coordinator.answer("a", 2, 1, "old", 0.1)

    coordinator.answer("a", 2, 2, "new", 0.1)
    answer_missing(coordinator, 0.2, step=1, digest="old")
    view = only_commit(coordinator.take_actions()).view

    assert (view.resume_step, view.digest) == (2, "new")
    assert view.fetch == {"b": ("a",), "c": ("a",)}


# --- answers that must be refused ------------------------------------------------


@pytest.mark.parametrize(
    ("member_id", "epoch", "step", "error"),
    [
        pytest.param("b", 4, 0, StaleEpoch, id="stale epoch"),
        pytest.param("b", 6, 0, InvalidRequest, id="future epoch"),
        pytest.param("late", 5, 0, NotAMember, id="pending joiner"),
        pytest.param("nobody", 5, 0, NotAMember, id="unknown id"),
        pytest.param("b", 5, -1, InvalidRequest, id="negative step"),
    ],
)
def test_bad_answer_during_a_rollcall_is_refused_and_changes_nothing(
    member_id: str, epoch: int, step: int, error: type[Exception]
) -> None:
    coordinator = established("a", "b", epoch=4)
    assert rollcall_over(coordinator, "c", 0.0) == 5
    coordinator.answer("a", 5, 3, "d", 0.01)
    coordinator.join(worker("late"), 0.02)
    before = snapshot(coordinator)

    with pytest.raises(error):
        coordinator.answer(member_id, epoch, step, "d", 0.03)

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


# With no roll call open every answer is late, even one for an epoch this
# coordinator never called: after a leader failover it may belong to the old
# leader's roll call, and the service ignores StaleEpoch answers.


@pytest.mark.parametrize("epoch", [3, 4, 5])
def test_answer_with_no_rollcall_open_is_refused_as_stale_and_changes_nothing(
    epoch: int,
) -> None:
    coordinator = established("a", "b", epoch=4)
    before = snapshot(coordinator)

    with pytest.raises(StaleEpoch):
        coordinator.answer("a", epoch, 0, "d", 0.0)

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


@pytest.mark.parametrize("epoch", [5, 6])
def test_answer_during_a_pending_commit_is_refused_as_stale_and_changes_nothing(
    epoch: int,
) -> None:
    coordinator = established("a", "b", epoch=4)
    rollcall_over(coordinator, "c", 0.0)
    coordinator.answer("a", 5, 0, "d", 0.1)
    coordinator.answer("c", 5, None, "", 0.1)
    coordinator.tick(SETTLE + HELD)
    coordinator.take_actions()
    before = snapshot(coordinator)

    with pytest.raises(StaleEpoch):
        coordinator.answer("b", epoch, 0, "d", SETTLE + HELD)

    assert snapshot(coordinator) == before
    assert coordinator.take_actions() == []


def test_commit_of_a_view_that_was_not_proposed_is_refused() -> None:
    coordinator = established("a")
    rollcall_over(coordinator, "b", 0.0)
    answer_missing(coordinator, 0.1)
    proposal = only_commit(coordinator.take_actions())

    with pytest.raises(NotProposed):
        coordinator.committed(View(proposal.view.epoch + 1, ()), 0.2)

    assert coordinator.proposal == proposal
    assert coordinator.view.epoch == 1


# --- next_wakeup -----------------------------------------------------------------


def test_idle_coordinator_needs_no_wakeup() -> None:
    assert established("a").next_wakeup() is None


def test_wakeup_after_a_join_is_the_end_of_join_settle() -> None:
    coordinator = established("a")

    coordinator.join(worker("b"), 2.0)
    coordinator.join(worker("c"), 2.01)

    assert coordinator.next_wakeup() == 2.0 + SETTLE


def test_wakeup_during_a_rollcall_is_its_deadline() -> None:
    coordinator = established("a")
    coordinator.join(worker("b"), 2.0)
    coordinator.tick(2.0 + SETTLE)
    coordinator.join(worker("c"), 2.0 + SETTLE)

    assert coordinator.next_wakeup() == 2.0 + SETTLE + HELD


def test_no_wakeup_while_a_commit_is_pending() -> None:
    coordinator = established("a")
    rollcall_over(coordinator, "b", 0.0)
    answer_missing(coordinator, 0.1)

    coordinator.join(worker("c"), 0.2)

    assert coordinator.next_wakeup() is None


def test_wakeup_after_commit_is_the_deferred_join_settle() -> None:
    coordinator = established("a")
    rollcall_over(coordinator, "b", 0.0)
    answer_missing(coordinator, 0.1)
    coordinator.join(worker("c"), 0.2)

    commit(coordinator, 0.21)

    assert coordinator.rollcall is None
    assert coordinator.next_wakeup() == 0.2 + SETTLE


# --- a new leader waiting for the view's members -------------------------------------


def adopted(*member_ids: str, awaiting: tuple[str, ...]) -> Coordinator:
    """A new leader's coordinator: view 1 of ``member_ids``, not yet heard
    from ``awaiting``."""
    view = View(1, tuple(worker(i) for i in member_ids))
    return Coordinator(CONFIG, view, now=0.0, awaiting=awaiting)


def test_no_rollcall_starts_while_a_member_of_the_view_has_not_reconnected() -> None:
    coordinator = adopted("a", "b", awaiting=("a", "b"))
    coordinator.reconnected("a", 0.1)

    coordinator.join(worker("c"), 0.2)
    coordinator.tick(10.0)

    assert coordinator.rollcall is None and coordinator.take_actions() == []
    assert coordinator.awaiting == {"b"}
    assert coordinator.next_wakeup() is None


def test_rollcall_starts_once_the_last_member_reconnects_and_calls_everyone() -> None:
    coordinator = adopted("a", "b", awaiting=("a", "b"))
    coordinator.join(worker("c"), 0.2)
    coordinator.reconnected("a", 0.3)

    coordinator.reconnected("b", 0.4)

    actions = coordinator.take_actions()
    assert actions == [RequestAnswers(2, ("a", "b", "c"))]


@pytest.mark.parametrize("depart", ["leave", "suspect"])
def test_a_member_not_reconnected_that_departs_ends_the_wait(depart: str) -> None:
    coordinator = adopted("a", "b", awaiting=("b",))

    getattr(coordinator, depart)("b", 0.5)

    assert coordinator.awaiting == frozenset()
    rollcall = coordinator.rollcall
    assert rollcall is not None and [c.id for c in rollcall.candidates] == ["a"]


def test_awaiting_ids_outside_the_view_are_ignored() -> None:
    coordinator = adopted("a", awaiting=("z",))

    coordinator.join(worker("c"), 0.0)
    coordinator.tick(SETTLE)

    assert coordinator.awaiting == frozenset() and coordinator.rollcall is not None


# --- plan_resume on its own --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from("abcdefgh"),
        st.tuples(st.none() | st.integers(0, 3), st.sampled_from(["x", "y", "z"])),
        min_size=1,
    ),
    st.sets(st.sampled_from("abcdefgh")),
    st.none() | st.integers(0, 3),
    st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 3)),
    st.randoms(use_true_random=False),
)
def test_plan_resume_fits_the_answers_whatever_their_arrival_order(
    raw: dict[str, tuple[int | None, str]],
    survivor_ids: set[str],
    resume: int | None,
    reports: dict[str, int],
    random: Random,
) -> None:
    order = sorted(raw, key=lambda i: (i not in survivor_ids, i))  # survivors first
    previous = View(1, tuple(worker(i) for i in sorted(survivor_ids)), resume)
    arrival = list(raw)
    random.shuffle(arrival)
    survivors = [i for i in order if i in survivor_ids]

    plan = plan_resume(
        order, {i: Answer(i, *raw[i]) for i in arrival}, survivors=survivors, resume=resume,
        reports=reports,
    )  # fmt: skip

    in_order = plan_resume(
        order, {i: Answer(i, *raw[i]) for i in order}, survivors=survivors, resume=resume,
        reports=reports,
    )  # fmt: skip
    assert plan == in_order
    view = View(2, tuple(worker(i) for i in order), plan.step, plan.digest, plan.fetch)
    check_resume_plan(view, raw, previous, reports)


def believed_steps(
    view: View,
    answers: Mapping[str, tuple[int | None, str]],
    previous: View,
    reports: Mapping[str, int],
) -> dict[str, int]:
    """The steps docs/protocol.md says the view believes: survivors' only,
    each at most one past the resume step of ``previous`` and the other
    survivors' steps (or, if none of those holds a step, the reports)."""
    steps = {
        i: step
        for i in view.ids
        if i in previous and (step := answers[i][0]) is not None
    }
    believed = {}
    for member_id, step in steps.items():
        vouching = [s for other, s in steps.items() if other != member_id] or list(
            reports.values()
        )
        known = [s for s in [previous.resume_step, *vouching] if s is not None]
        if not known or step <= max(known) + 1:
            believed[member_id] = step
    return believed


def check_resume_plan(
    view: View,
    answers: Mapping[str, tuple[int | None, str]],
    previous: View,
    reports: Mapping[str, int],
) -> None:
    """``view``'s resume step, digest and fetch plan fit its members'
    answers as claims checked against the job's progress."""
    believed = believed_steps(view, answers, previous, reports)
    expected = max(believed.values(), default=None)
    assert view.resume_step == expected
    if expected is None:
        assert view.digest == ""
        assert view.fetch == {}
        return
    holders = [i for i in view.ids if believed.get(i) == expected]
    counts = Counter(answers[i][1] for i in holders)
    assert counts[view.digest] == max(counts.values())
    senior = next(i for i in holders if counts[answers[i][1]] == max(counts.values()))
    assert view.digest == answers[senior][1], "a digest tie goes to the most senior holder"
    sources = {i for i in holders if answers[i][1] == view.digest}
    assert sources <= set(previous.ids), "a joiner is a source"
    assert set(view.fetch) <= set(view.ids)
    for member_id in view.ids:
        if member_id in sources:
            assert member_id not in view.fetch
        else:
            assert view.fetch.get(member_id), f"{member_id} must fetch"
            assert set(view.fetch[member_id]) <= sources


# --- generated event sequences ------------------------------------------------------

DELAYS = st.sampled_from([0.0, 0.001, SETTLE / 2, SETTLE, DEADLINE / 2, DEADLINE, 3.0]) | st.floats(
    0.0, 3.0, allow_nan=False
)
STEPS = st.none() | st.integers(0, 4)
DIGESTS = st.sampled_from(["x", "y", "z"])


class RollCallMachine(RuleBasedStateMachine):
    """Drives a coordinator the way the leader replica does and checks every
    action it emits and every view it has committed."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.coordinator = Coordinator(CONFIG, EMPTY_VIEW, self.now)
        self.issued: list[str] = []  # every id that ever joined, in arrival order
        self.joined_at: dict[str, float] = {}
        self.departed: set[str] = set()  # ids passed to leave or suspect
        self.queued: set[str] = set()  # departures and rechecks not yet called
        self.dropped: set[str] = set()  # candidates left out of their roll call's view
        self.gone: set[str] = set()  # ids of a committed view missing from a later one
        self.views: list[View] = [EMPTY_VIEW]  # committed, in order
        self.called: dict[int, tuple[str, ...]] = {}  # epoch -> candidates at start
        self.answers: dict[int, dict[str, tuple[int | None, str]]] = {}
        self.unsettled: dict[int, set[str]] = {}  # epoch -> who answered unsettled
        self.put_offs = 0  # views in a row that put joins off
        #: Progress reported by members of the view in force, in it.
        self.reports: dict[str, int] = {}
        self.pending: CommitView | None = None

    # --- the caller's loop ---

    def drain(self) -> None:
        for action in self.coordinator.take_actions():
            if isinstance(action, RequestAnswers):
                self.on_request(action)
            else:
                self.on_commit_view(action)

    def on_request(self, request: RequestAnswers) -> None:
        previous = self.views[-1]
        ids = request.member_ids
        assert self.pending is None, "roll call started while a commit is pending"
        assert request.epoch == previous.epoch + 1
        assert request.epoch not in self.called, "two roll calls for one epoch"
        assert len(set(ids)) == len(ids)
        assert not set(ids) & self.departed, "departed member called"
        assert not set(ids) & (self.gone | self.dropped), "removed member called again"
        survivors = [i for i in ids if i in previous]
        assert ids[: len(survivors)] == tuple(survivors), "joiner called before a survivor"
        assert survivors == [i for i in previous.ids if i in survivors]
        self.called[request.epoch] = ids
        self.answers[request.epoch] = {}
        self.unsettled[request.epoch] = set()
        self.queued.clear()

    def on_commit_view(self, proposal: CommitView) -> None:
        view = proposal.view
        assert self.pending is None, "second view proposed before the first was committed"
        assert proposal.previous == self.views[-1]
        assert view.epoch == self.views[-1].epoch + 1
        called = self.called[view.epoch]
        answered = self.answers[view.epoch]
        assert set(view.ids) <= set(answered), "member that did not answer is in the view"
        assert view.ids == tuple(i for i in called if i in view), "view is not in call order"
        assert not set(view.ids) & self.departed, "departed member kept"
        assert set(self.views[-1].ids) - set(view.ids) <= set(proposal.removed)
        unsettled = self.unsettled[view.epoch]
        later: set[str] = set()
        if proposal.unsettled:
            # Nobody takes the state of holders that answered before their
            # loop's code ran: the view is those holders, nobody fetches,
            # joiners wait for the next roll call, other survivors go.
            assert set(proposal.unsettled) == unsettled & set(view.ids)
            assert view.fetch == {}
            assert all(answered[i][0] == view.resume_step for i in view.ids)
            assert proposal.put_off == tuple(
                i for i in called if i in answered and i not in view and i not in self.departed
            )
            later = {i for i in proposal.put_off if i not in self.views[-1]}
            assert not later & set(proposal.removed), "a joiner put off was evicted"
            # They wait for the next roll call a deadline from now, twice
            # as long for each view in a row that put joins off (at most 32).
            wait = DEADLINE * 2 ** min(self.put_offs, 5)
            for joiner in later:
                self.joined_at[joiner] = self.now + wait - SETTLE
        else:
            check_resume_plan(
                view, {i: answered[i] for i in view.ids}, self.views[-1], self.reports
            )
            sources = [i for i in view.ids if i not in view.fetch]
            assert view.resume_step is None or not unsettled & set(sources), (
                "state taken from a holder that answered unsettled"
            )
        self.put_offs = self.put_offs + 1 if later else 0
        self.dropped |= set(called) - set(view.ids) - later
        self.pending = proposal

    def commit(self) -> None:
        assert self.pending is not None
        view, self.pending = self.pending.view, None
        previous = self.views[-1]
        assert view.epoch == previous.epoch + 1, "epochs must increase by exactly one"
        assert [view.rank_of(i) for i in view.ids] == list(range(view.size)), "ranks not dense"
        assert not set(view.ids) & self.gone, "departed id reappeared"
        survivors = tuple(i for i in previous.ids if i in view)
        assert view.ids[: len(survivors)] == survivors, "survivor order changed or joiner first"
        assert sorted(view.ids, key=self.issued.index) == list(view.ids), "not in arrival order"
        self.gone |= set(previous.ids) - set(view.ids)
        self.views.append(view)
        self.reports = {}
        self.coordinator.committed(view, self.now)
        assert self.coordinator.view == view
        self.drain()

    def answer_all(self, data: st.DataObject) -> None:
        rollcall = self.coordinator.rollcall
        assert rollcall is not None
        for member_id in rollcall.missing:
            self.answer_as(member_id, data.draw(STEPS), data.draw(DIGESTS))

    def answer_as(
        self, member_id: str, step: int | None, digest: str, unsettled: bool = False
    ) -> None:
        rollcall = self.coordinator.rollcall
        assert rollcall is not None
        self.coordinator.answer(
            member_id, rollcall.epoch, step, digest, self.now, unsettled=unsettled
        )
        self.answers[rollcall.epoch][member_id] = (step, digest)
        self.unsettled[rollcall.epoch].discard(member_id)
        if unsettled:
            self.unsettled[rollcall.epoch].add(member_id)
        self.drain()

    def last_called_epoch(self) -> int:
        rollcall = self.coordinator.rollcall
        if rollcall is not None:
            return rollcall.epoch
        return self.pending.view.epoch if self.pending is not None else self.views[-1].epoch

    # --- events ---

    @initialize(size=st.integers(0, 6), epoch=st.integers(1, 5))
    def start_from_a_committed_view(self, size: int, epoch: int) -> None:
        if size:
            self.issued = [f"w{i}" for i in range(size)]
            self.joined_at = dict.fromkeys(self.issued, self.now)
            self.views = [View(epoch, tuple(worker(i) for i in self.issued))]
            self.coordinator = Coordinator(CONFIG, self.views[0], self.now)

    @rule(count=st.integers(1, 4))
    def join(self, count: int) -> None:
        for _ in range(count):
            member_id = f"w{len(self.issued)}"
            self.issued.append(member_id)
            self.joined_at[member_id] = self.now
            self.coordinator.join(worker(member_id), self.now)
            self.drain()

    @precondition(lambda self: any(self.coordinator.knows(i) for i in self.issued))
    @rule(data=st.data(), how=st.sampled_from(["leave", "suspect"]))
    def depart(self, data: st.DataObject, how: str) -> None:
        member_id = data.draw(
            st.sampled_from([i for i in self.issued if self.coordinator.knows(i)])
        )
        before = snapshot(self.coordinator)
        self.departed.add(member_id)
        if not getattr(self.coordinator, how)(member_id, self.now):
            assert snapshot(self.coordinator) == before, "refused departure changed state"
        proposal = self.coordinator.proposal
        if (
            self.coordinator.rollcall is None
            and proposal is not None
            and member_id in proposal.view
        ):
            self.queued.add(member_id)
        self.drain()

    @precondition(lambda self: any(self.coordinator.knows(i) for i in self.issued))
    @rule(data=st.data())
    def peer_reports_a_failure(self, data: st.DataObject) -> None:
        member_id = data.draw(
            st.sampled_from([i for i in self.issued if self.coordinator.knows(i)])
        )
        before = snapshot(self.coordinator)
        if self.coordinator.recheck(member_id, Cause.report(member_id, "a peer"), self.now):
            self.queued.add(member_id)
        else:
            assert snapshot(self.coordinator) == before, "refused recheck changed state"
        self.drain()

    @precondition(lambda self: self.coordinator.view.size > 0)
    @rule(data=st.data())
    def member_reports_a_failure_within_its_limit(self, data: st.DataObject) -> None:
        view = self.coordinator.view
        reporter = data.draw(st.sampled_from(view.ids))
        member_id = data.draw(st.sampled_from([*view.ids, "nobody"]))
        before = snapshot(self.coordinator)
        outcome = self.coordinator.report(reporter, member_id, self.now)
        if outcome is ReportOutcome.ROLL_CALL:
            self.queued.add(member_id)
        else:
            assert snapshot(self.coordinator) == before, "an ignored report changed state"
        self.drain()

    @rule(data=st.data(), step=st.integers(0, 4), stale=st.booleans())
    def member_reports_progress(self, data: st.DataObject, step: int, stale: bool) -> None:
        view = self.coordinator.view
        member_id = data.draw(st.sampled_from([*view.ids, "nobody"]))
        epoch = view.epoch - 1 if stale else view.epoch
        self.coordinator.progress(member_id, epoch, step)
        if member_id in view and not stale:
            self.reports[member_id] = max(step, self.reports.get(member_id, step))

    @rule(data=st.data(), how=st.sampled_from(["leave", "suspect"]))
    def depart_unknown(self, data: st.DataObject, how: str) -> None:
        strangers = [i for i in self.issued if not self.coordinator.knows(i)] + ["nobody"]
        member_id = data.draw(st.sampled_from(strangers))
        before = snapshot(self.coordinator)

        assert getattr(self.coordinator, how)(member_id, self.now) is False

        assert snapshot(self.coordinator) == before
        assert self.coordinator.take_actions() == []

    @precondition(lambda self: self.coordinator.rollcall is not None)
    @rule(data=st.data(), step=STEPS, digest=DIGESTS, unsettled=st.booleans())
    def answer(self, data: st.DataObject, step: int | None, digest: str, unsettled: bool) -> None:
        rollcall = self.coordinator.rollcall
        assert rollcall is not None
        self.answer_as(
            data.draw(st.sampled_from([c.id for c in rollcall.candidates])), step, digest,
            unsettled,
        )  # fmt: skip

    @precondition(lambda self: self.coordinator.rollcall is not None)
    @rule(data=st.data())
    def everyone_answers(self, data: st.DataObject) -> None:
        self.answer_all(data)

    @rule(data=st.data(), kind=st.sampled_from(["stale", "future", "stranger"]))
    def bad_answer(self, data: st.DataObject, kind: str) -> None:
        rollcall = self.coordinator.rollcall
        called = self.last_called_epoch()
        member_id = data.draw(st.sampled_from(self.issued + ["nobody"]))
        error: type[Exception]
        if rollcall is None:
            epoch, error = data.draw(st.integers(-1, called + 3)), StaleEpoch
        elif kind == "future":
            epoch, error = data.draw(st.integers(called + 1, called + 3)), InvalidRequest
        elif kind == "stale":
            epoch, error = data.draw(st.integers(-1, called - 1)), StaleEpoch
        else:
            strangers = [i for i in self.issued if not rollcall.is_candidate(i)] + ["nobody"]
            member_id, epoch, error = data.draw(st.sampled_from(strangers)), called, NotAMember
        before = snapshot(self.coordinator)

        with pytest.raises(error):
            self.coordinator.answer(member_id, epoch, data.draw(STEPS), "x", self.now)

        assert snapshot(self.coordinator) == before
        assert self.coordinator.take_actions() == []

    @rule(delay=DELAYS)
    def time_passes(self, delay: float) -> None:
        self.now += delay
        self.coordinator.tick(self.now)
        self.drain()

    @rule()
    def time_passes_to_wakeup(self) -> None:
        wakeup = self.coordinator.next_wakeup()
        if wakeup is not None:
            self.now = max(self.now, wakeup)
        self.coordinator.tick(self.now)
        self.drain()

    @precondition(lambda self: self.pending is not None)
    @rule()
    def commit_succeeds(self) -> None:
        self.commit()

    @rule(data=st.data())
    def run_until_quiet_with_everyone_answering(self, data: st.DataObject) -> None:
        coordinator = self.coordinator
        for _ in range(20):
            if self.pending is not None:
                self.commit()
            elif coordinator.rollcall is not None:
                self.answer_all(data)
            elif (wakeup := coordinator.next_wakeup()) is not None:
                self.now = max(self.now, wakeup)
                coordinator.tick(self.now)
                self.drain()
            else:
                break
        else:
            raise AssertionError("the coordinator never became quiet")

        assert coordinator.pending_joiners == ()
        assert coordinator.proposal is None
        staying = [i for i in self.issued if i not in self.departed | self.dropped]
        assert coordinator.view.ids == tuple(staying), "a pending join never made it in"

    # --- invariants ---

    @invariant()
    def never_stalls(self) -> None:
        coordinator = self.coordinator
        wakeup = coordinator.next_wakeup()
        assert (coordinator.proposal is None) == (self.pending is None)
        if coordinator.rollcall is not None:
            assert wakeup == coordinator.rollcall.deadline > self.now
        elif self.queued:
            assert coordinator.proposal is not None, "departure or recheck not called at once"
        elif coordinator.proposal is None and coordinator.pending_joiners:
            first = min(self.joined_at[j.id] for j in coordinator.pending_joiners)
            assert wakeup is not None, "pending joiners but no wakeup"
            assert self.now < wakeup <= first + SETTLE


RollCallMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_rollcall_machine = RollCallMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(
    steps=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 6), min_size=1),
    resume=st.none() | st.integers(0, 6),
    reports=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 6)),
)
def test_every_survivors_bound_at_once_is_progress_bound_of_each(
    steps: dict[str, int], resume: int | None, reports: dict[str, int]
) -> None:
    from rollcall.membership.coordinator import _ProgressBounds, progress_bound

    bounds = _ProgressBounds(steps, resume, reports)
    for member_id in steps:
        assert bounds.of(member_id) == progress_bound(member_id, steps, resume, reports)
