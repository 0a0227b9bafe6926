"""The leader's policy: events in, actions out, time passed in.

Unit tests pin one behaviour each; the state machine at the end drives
generated event sequences (sessions, heartbeats, answers, reports, busy
periods, commits, probes, the leader's own lag, etcd outages) and checks
that every epoch gets exactly one view and that nobody is evicted without
evidence about it.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from rollcall.membership.cause import Cause, CauseKind
from rollcall.membership.config import Config
from rollcall.membership.coordinator import CommitView, RequestAnswers
from rollcall.membership.leader import (
    Action,
    Evict,
    Evidence,
    KeepLeasesAlive,
    Leader,
    PeerBusy,
    WriteProgress,
)
from rollcall.membership.view import Member, View

CONFIG = Config()
CARRIER = "@1"
HEARTBEAT = CONFIG.heartbeat_interval
EARLIEST = CONFIG.earliest_suspicion()


def worker(member_id: str) -> Member:
    return Member(member_id, f"{member_id}.example:29500")


def view_of(*member_ids: str, epoch: int = 1, resume: int | None = None) -> View:
    return View(epoch, tuple(worker(i) for i in member_ids), resume_step=resume)


def connected(*member_ids: str, now: float = 0.0) -> Leader:
    """A leader that took over a view of ``member_ids``, all reconnected."""
    leader = Leader(CONFIG, view_of(*member_ids), now)
    for member_id in member_ids:
        leader.session_opened(member_id, now)
    leader.take_actions()
    return leader


def evictions(actions: list[Action]) -> list[Evict]:
    return [a for a in actions if isinstance(a, Evict)]


def heartbeats_until(leader: Leader, member_ids: tuple[str, ...], start: float, end: float) -> None:
    """Heartbeats of ``member_ids`` and ticks, every heartbeat interval."""
    now = start
    while now < end:
        now = min(now + HEARTBEAT, end)
        for member_id in member_ids:
            leader.heard(member_id, now)
        leader.tick(now)


# --- suspicions ---------------------------------------------------------------


def test_a_broken_session_stream_evicts_the_member_for_it() -> None:
    leader = connected("a", "b")

    leader.session_broken("b", 0.5)

    (evict,) = evictions(leader.take_actions())
    assert evict.cause == Cause.suspect("b") and evict.evidence is Evidence.STREAM_BROKEN
    assert evict.counted and evict.reason == "session stream broken"


def test_a_silent_member_is_suspected_by_the_detector_and_a_heartbeating_one_is_not() -> None:
    leader = connected("a", "b")
    heartbeats_until(leader, ("a",), 0.0, CONFIG.max_silence + HEARTBEAT)

    (evict,) = evictions(leader.take_actions())
    assert evict.member_id == "b" and evict.evidence is Evidence.DETECTOR
    assert evict.silence_s >= EARLIEST


def test_a_busy_member_is_not_suspected_while_its_period_lasts() -> None:
    leader = connected("a", "b")
    leader.declare_busy("b", 10.0, "checkpoint", 0.0)
    heartbeats_until(leader, ("a",), 0.0, 5.0)

    actions = leader.take_actions()
    assert evictions(actions) == []
    assert actions == [PeerBusy("b", 10.0, "checkpoint")]


def test_a_busy_period_that_runs_out_ends_and_silence_counts_from_then() -> None:
    leader = connected("a", "b")
    leader.declare_busy("b", 1.0, "checkpoint", 0.0)
    leader.take_actions()
    heartbeats_until(leader, ("a",), 0.0, 1.0 + EARLIEST / 2)

    assert leader.take_actions() == [PeerBusy("b", 0.0, "", overran=True)]
    heartbeats_until(leader, ("a",), 1.0 + EARLIEST / 2, 1.0 + CONFIG.max_silence + HEARTBEAT)
    assert [e.member_id for e in evictions(leader.take_actions())] == ["b"]


def test_a_late_wake_defers_the_detector_for_one_round() -> None:
    leader = connected("a")
    heartbeats_until(leader, ("a",), 0.0, 1.0)
    leader.take_actions()
    planned = 1.0 + HEARTBEAT

    late = leader.woke(planned + CONFIG.max_silence, planned)
    leader.tick(planned + CONFIG.max_silence)

    assert late == CONFIG.max_silence and leader.lagging
    assert evictions(leader.take_actions()) == []
    leader.heard("a", planned + CONFIG.max_silence)  # what was waiting in the queue
    leader.woke(planned + CONFIG.max_silence, None)
    leader.tick(planned + CONFIG.max_silence)
    assert evictions(leader.take_actions()) == []


def test_two_late_wakes_in_a_row_defer_only_the_first_round() -> None:
    leader = connected("a")
    leader.tick(0.0)
    leader.woke(10.0, 1.0)

    assert leader.woke(20.0, 11.0) is None and not leader.lagging
    leader.tick(20.0)
    assert [e.member_id for e in evictions(leader.take_actions())] == ["a"]


def test_a_joiner_that_never_opens_a_session_is_suspected_at_its_deadline() -> None:
    leader = connected("a")
    leader.joined(worker("j"), 0.0)
    heartbeats_until(leader, ("a",), 0.0, CONFIG.join_session_timeout - HEARTBEAT)
    assert evictions(leader.take_actions()) == []

    heartbeats_until(leader, ("a",), CONFIG.join_session_timeout - HEARTBEAT,
                     CONFIG.join_session_timeout)  # fmt: skip

    (evict,) = evictions(leader.take_actions())
    assert evict.member_id == "j" and evict.evidence is Evidence.NO_SESSION


def test_a_joiner_is_called_only_once_its_session_is_open() -> None:
    leader = connected("a", "b")
    leader.joined(worker("j"), 0.0)
    leader.leave("b", 0.01)  # a roll call before j opened its session
    (request,) = [a for a in leader.take_actions() if isinstance(a, RequestAnswers)]
    assert request.member_ids == ("a",)
    leader.answer("a", request.epoch, None, "", 0.02)
    (proposal,) = [a for a in leader.take_actions() if isinstance(a, CommitView)]
    leader.committed(proposal.view, 0.03)
    assert "j" not in [e.member_id for e in evictions(leader.take_actions())]

    leader.session_opened("j", 0.5)
    leader.tick(0.5 + CONFIG.join_settle)

    (request,) = [a for a in leader.take_actions() if isinstance(a, RequestAnswers)]
    assert request.member_ids == ("a", "j")


def test_an_absent_member_whose_process_answers_is_kept_and_said_once() -> None:
    leader = Leader(CONFIG, view_of("a", "b"), 0.0)
    leader.session_opened("a", 0.0)
    after = CONFIG.takeover_grace

    assert leader.absent() == ("b",)
    assert leader.probed(worker("b"), True, after) is True
    assert leader.probed(worker("b"), True, 2 * after) is False
    assert evictions(leader.take_actions()) == []


def test_an_absent_member_whose_process_does_not_answer_is_suspected() -> None:
    leader = Leader(CONFIG, view_of("a", "b"), 0.0)
    leader.session_opened("a", 0.0)

    leader.probed(worker("b"), False, CONFIG.takeover_grace)

    (evict,) = evictions(leader.take_actions())
    assert evict.evidence is Evidence.ABSENT
    assert evict.reason == f"{Evidence.ABSENT.value} b.example:29500"


def test_a_member_that_reconnected_meanwhile_is_not_suspected_for_its_probe() -> None:
    leader = Leader(CONFIG, view_of("a", "b"), 0.0)
    leader.session_opened("b", 1.0)

    leader.probed(worker("b"), False, CONFIG.takeover_grace)

    assert evictions(leader.take_actions()) == []


# --- leaves, commits and progress -----------------------------------------------


def test_a_leave_evicts_with_its_cause_before_the_roll_call_it_starts() -> None:
    leader = connected("a", "b")

    leader.leave("b", 0.1)

    evict, request = leader.take_actions()
    assert evict == Evict("b", Cause.leave("b"), 1)
    assert request == RequestAnswers(2, ("a",))


def test_a_commit_writes_the_old_views_last_step_and_evicts_who_lost_their_place() -> None:
    leader = connected("a", "b")
    leader.progress("a", 1, 7, 0.0)
    leader.suspect("b", Evidence.DETECTOR, 0.1)
    leader.take_actions()
    leader.answer("a", 2, 7, "d7", 0.2)
    (proposal,) = leader.take_actions()
    assert isinstance(proposal, CommitView)

    leader.committed(proposal.view, 0.3)

    assert leader.take_actions() == [WriteProgress(1, 7), Evict("b", None, 2)]
    assert leader.step == 7 and leader.view == proposal.view


def test_progress_written_is_not_written_again() -> None:
    leader = connected("a")
    leader.progress("a", 1, 3, 0.0)
    assert leader.progress_due() == WriteProgress(1, 3)

    leader.progress_written(1, 3)

    assert leader.progress_due() is None


def test_progress_of_an_old_epoch_or_a_stranger_does_not_count() -> None:
    leader = connected("a")

    assert leader.progress("a", 0, 5, 0.0) is None
    assert leader.progress("z", 1, 5, 0.0) is None
    assert leader.step is None and not leader.trained


def test_a_checkpoint_raises_the_progress_record_only_if_more_than_a_step_behind() -> None:
    leader = connected("a")
    leader.progress("a", 1, 9, 0.0)
    leader.progress_written(1, 8)

    assert leader.progress_for_checkpoint(9) is None
    assert leader.progress_for_checkpoint(10) == WriteProgress(1, 9)
    assert leader.progress_for_checkpoint(12) == WriteProgress(1, 9)


# --- shared sessions ------------------------------------------------------------------


def carried(*member_ids: str, key: str = "@1", own: tuple[str, ...] = ()) -> Leader:
    """A leader of a view of ``member_ids`` (on shared stream ``key``) and
    ``own`` (each on a stream of its own), all reconnected at 0."""
    leader = Leader(CONFIG, view_of(*member_ids, *own), 0.0)
    leader.carrier_opened(key, 0.0)
    for member_id in member_ids:
        leader.session_opened(member_id, 0.0, carrier=key)
    for member_id in own:
        leader.session_opened(member_id, 0.0)
    leader.take_actions()
    return leader


def test_a_shared_streams_heartbeats_keep_every_member_on_it() -> None:
    leader = carried("a", "b", "c")
    now = 0.0
    while now < 10.0:
        now += HEARTBEAT
        leader.carrier_heard("@1", now)
        leader.tick(now)

    assert evictions(leader.take_actions()) == []
    assert leader.leases(["a", "b", "c"], now) == KeepLeasesAlive(("a", "b", "c"))


def test_a_silent_shared_stream_suspects_its_members_but_not_a_busy_one_nor_others() -> None:
    leader = carried("a", "b", "c", own=("d",))
    leader.declare_busy("b", 60.0, "evaluation", 0.0)
    leader.take_actions()
    heartbeats_until(leader, ("d",), 0.0, CONFIG.max_silence + 0.1)

    suspected = evictions(leader.take_actions())

    assert sorted(e.member_id for e in suspected) == ["a", "c"]
    assert all(e.evidence is Evidence.DETECTOR for e in suspected)
    assert all(e.silence_s >= EARLIEST for e in suspected)
    # The busy one is spared, and no scan is due at once again for it.
    assert leader.next_wakeup(CONFIG.max_silence + 0.1) > CONFIG.max_silence + 0.2


def test_a_broken_shared_stream_suspects_each_member_on_it() -> None:
    leader = carried("a", "b", own=("c",))

    leader.carrier_ended("@1", 0.5, broken=True)

    suspected = evictions(leader.take_actions())
    assert [(e.member_id, e.evidence) for e in suspected] == [
        ("a", Evidence.STREAM_BROKEN), ("b", Evidence.STREAM_BROKEN),
    ]  # fmt: skip
    assert leader.coordinator.rollcall is not None


def test_members_of_a_refused_shared_stream_are_watched_alone_from_its_last_heartbeat() -> None:
    leader = carried("a", "b")
    leader.carrier_heard("@1", 1.0)

    leader.carrier_ended("@1", 1.2, broken=False)
    assert evictions(leader.take_actions()) == []
    leader.session_opened("a", 1.3)  # a came back on a stream of its own
    heartbeats_until(leader, ("a",), 1.3, 1.0 + CONFIG.max_silence + 0.1)

    (evict,) = evictions(leader.take_actions())
    assert evict.member_id == "b" and evict.evidence is Evidence.DETECTOR


def test_a_member_taken_off_a_shared_stream_is_suspected_with_what_its_holder_saw() -> None:
    leader = carried("a", "b")

    leader.carried_closed("a", silent=False, now=0.2)
    leader.carried_closed("b", silent=True, now=0.2)

    assert [(e.member_id, e.evidence) for e in evictions(leader.take_actions())] == [
        ("a", Evidence.STREAM_BROKEN), ("b", Evidence.SILENT_ON_CARRIER),
    ]  # fmt: skip


def test_a_shared_stream_counts_once_in_the_heartbeat_pace() -> None:
    config = CONFIG.replace(heartbeat_rate_max=40.0)  # 4 streams at 0.1 s
    ids = tuple(f"m{n}" for n in range(12))
    leader = Leader(config, view_of(*ids), 0.0)
    leader.carrier_opened("@1", 0.0)
    for member_id in ids:
        leader.session_opened(member_id, 0.0, carrier="@1")

    assert leader.heartbeating() == 1
    assert config.heartbeat_interval_for(leader.heartbeating()) == config.heartbeat_interval


# --- leases ---------------------------------------------------------------------------


def test_leases_are_kept_for_healthy_sessions_and_within_grace_periods() -> None:
    leader = Leader(CONFIG, view_of("a", "b"), 0.0)
    leader.session_opened("a", 0.0)
    leader.joined(worker("j"), 0.0)

    assert leader.leases(["a", "b", "j"], 0.1) == KeepLeasesAlive(("a", "b", "j"))
    later = CONFIG.join_session_timeout + 1.0
    leader.heard("a", later)
    # b is awaited (it may be held by a previous leader): its lease is kept.
    assert leader.leases(["a", "b", "j"], later) == KeepLeasesAlive(("a", "b"))


def test_a_suspected_session_loses_its_lease_unless_busy() -> None:
    leader = connected("a", "b")
    leader.declare_busy("b", 60.0, "", 0.0)
    late = CONFIG.max_silence + 1.0

    assert leader.leases(["a", "b"], late) == KeepLeasesAlive(("b",))


# --- generated sequences ------------------------------------------------------------


class LeaderMachine(RuleBasedStateMachine):
    """Random sessions, heartbeats, answers, reports, busy periods, commits,
    probes, lag and etcd outages against one ``Leader``.

    Model: every member is either ``alive`` (it heartbeats whenever time
    passes, so long as its session is open) or silent. The checks: each
    epoch gets one view, in order; every suspicion names evidence the model
    can confirm (its stream broke, it was silent for at least the
    detector's earliest suspicion and not busy, a joiner without a session
    past its deadline, a probe nobody answered); a lagging leader suspects
    nobody in its late round; and etcd outages suspect nobody."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.leader = Leader(CONFIG, view_of(), 0.0)
        self.issued: list[str] = []
        self.alive: set[str] = set()
        self.heard_at: dict[str, float] = {}
        self.joined_at: dict[str, float] = {}
        self.alive_with_sessions_before: set[str] = set()
        self.busy_until: dict[str, float] = {}
        self.removed: set[str] = set()
        self.pending: CommitView | None = None
        self.epochs: list[int] = [0]
        #: Evidence the next actions may cite: (member, evidence).
        self.expected: set[tuple[str, Evidence]] = set()
        #: Whether the shared stream is open, and the members on it (a
        #: heartbeat of any live one stands for all, as its holder's would).
        self.carrier_up = False
        self.carried: set[str] = set()

    # --- checks ---

    def drain(self, *, lagging: bool = False) -> None:
        for action in self.leader.take_actions():
            if isinstance(action, CommitView):
                assert self.pending is None, "a second view proposed before the first committed"
                assert action.view.epoch == self.epochs[-1] + 1, "an epoch skipped or repeated"
                self.pending = action
            elif isinstance(action, Evict):
                self.check_evidence(action, lagging)
                self.removed.add(action.member_id)
                self.alive.discard(action.member_id)
            elif isinstance(action, RequestAnswers):
                assert action.epoch == self.epochs[-1] + 1
        self.expected.clear()

    def check_evidence(self, evict: Evict, lagging: bool) -> None:
        member_id = evict.member_id
        if evict.cause is None or evict.cause.kind is CauseKind.LEAVE:
            return
        assert evict.cause == Cause.suspect(member_id)
        evidence = evict.evidence
        assert evidence is not None, "a suspicion without evidence"
        if evidence is Evidence.DETECTOR:
            assert not lagging, "suspected for the leader's own lag"
            silence = self.now - self.heard_at[member_id]
            assert silence >= EARLIEST - 1e-9, f"{member_id} suspected after {silence:.3f} s"
            assert self.busy_until.get(member_id, -1.0) <= self.now, "a busy member suspected"
        elif evidence is Evidence.NO_SESSION:
            assert member_id in self.joined_at, "a member that opened its session"
            assert self.now >= self.joined_at[member_id] + CONFIG.join_session_timeout
        else:
            assert (member_id, evidence) in self.expected, f"{evidence} for {member_id} unseen"

    def known(self) -> list[str]:
        return [i for i in self.issued if i not in self.removed and self.leader.knows(i)]

    def with_session(self) -> list[str]:
        """Members with an open session (known or not: one that a proposal
        drops still heartbeats until it is evicted)."""
        return [i for i in self.issued if i not in self.removed and self.leader.has_session(i)]

    # --- events ---

    @initialize(
        size=st.integers(0, 4), epoch=st.integers(1, 3), resume=st.none() | st.integers(0, 9)
    )
    def take_over(self, size: int, epoch: int, resume: int | None) -> None:
        self.issued = [f"w{i}" for i in range(size)]
        self.leader = Leader(CONFIG, view_of(*self.issued, epoch=epoch, resume=resume), 0.0)
        self.leader.carrier_opened(CARRIER, 0.0)
        self.carrier_up = True
        self.epochs = [epoch]
        self.alive = set(self.issued)
        self.heard_at = dict.fromkeys(self.issued, 0.0)
        self.drain()

    @rule()
    def join(self) -> None:
        member_id = f"w{len(self.issued)}"
        self.issued.append(member_id)
        self.joined_at[member_id] = self.now
        self.heard_at[member_id] = self.now
        self.alive.add(member_id)
        self.leader.joined(worker(member_id), self.now)
        self.drain()

    @precondition(lambda self: any(not self.leader.has_session(i) for i in self.known()))
    @rule(data=st.data(), shared=st.booleans())
    def open_session(self, data: st.DataObject, shared: bool) -> None:
        """A member opens its session: on a stream of its own, or on the
        shared stream (whose heartbeats then stand for it)."""
        choices = [i for i in self.known() if not self.leader.has_session(i)]
        member_id = data.draw(st.sampled_from(choices))
        if shared and not self.carrier_up:
            self.leader.carrier_opened(CARRIER, self.now)
            self.carrier_up = True
        self.leader.session_opened(member_id, self.now, CARRIER if shared else None)
        self.carried.discard(member_id)
        if shared:
            self.carried.add(member_id)
        self.joined_at.pop(member_id, None)
        self.heard_at[member_id] = self.now
        self.drain()

    @precondition(lambda self: bool(self.with_session()))
    @rule(data=st.data(), how=st.sampled_from(["break", "reject", "freeze", "leave"]))
    def member_trouble(self, data: st.DataObject, how: str) -> None:
        member_id = data.draw(st.sampled_from(self.with_session()))
        if how == "break":
            self.expected.add((member_id, Evidence.STREAM_BROKEN))
            self.leader.session_broken(member_id, self.now)
        elif how == "reject":
            self.leader.session_rejected(member_id, self.now)
        elif how == "freeze":
            self.alive.discard(member_id)
        else:
            self.leader.leave(member_id, self.now)
        self.drain()

    @precondition(lambda self: self.carrier_up)
    @rule(broken=st.booleans())
    def shared_stream_ends(self, broken: bool) -> None:
        """The shared stream breaks (its holder died: every member on it is
        suspected) or is ended on a refused message (they are watched alone)."""
        riders = [i for i in self.with_session() if i in self.carried]
        if broken:
            self.expected.update((i, Evidence.STREAM_BROKEN) for i in riders)
        self.leader.carrier_ended(CARRIER, self.now, broken=broken)
        self.carrier_up = False
        self.carried.clear()
        self.drain()

    @precondition(lambda self: self.leader.coordinator.rollcall is not None)
    @rule(data=st.data(), step=st.none() | st.integers(0, 9))
    def answer(self, data: st.DataObject, step: int | None) -> None:
        rollcall = self.leader.coordinator.rollcall
        assert rollcall is not None
        answering = [i for i in rollcall.missing if self.leader.has_session(i)]
        chosen = data.draw(st.lists(st.sampled_from(answering), unique=True)) if answering else []
        for member_id in chosen:
            self.leader.answer(member_id, rollcall.epoch, step, f"d{step}", self.now)
            self.heard_at[member_id] = self.now
        self.drain()

    @precondition(lambda self: bool(self.with_session()))
    @rule(data=st.data(), step=st.integers(0, 9), seconds=st.sampled_from([0.0, 0.5, 5.0]))
    def member_message(self, data: st.DataObject, step: int, seconds: float) -> None:
        member_id = data.draw(st.sampled_from(self.with_session()))
        kind = data.draw(st.sampled_from(["progress", "report", "busy"]))
        if kind == "progress":
            self.leader.progress(member_id, self.leader.view.epoch, step, self.now)
        elif kind == "report":
            self.leader.heard(member_id, self.now)
            peer = data.draw(st.sampled_from([*self.leader.view.ids, member_id]))
            self.leader.report(member_id, peer, self.now)
        else:
            self.leader.declare_busy(member_id, seconds, "checkpoint", self.now)
            if seconds > 0:
                self.busy_until[member_id] = self.now + seconds
            else:
                self.busy_until.pop(member_id, None)
        self.heard_at[member_id] = self.now
        self.drain()

    @precondition(lambda self: self.pending is not None)
    @rule()
    def etcd_commits(self) -> None:
        assert self.pending is not None
        view, self.pending = self.pending.view, None
        self.epochs.append(view.epoch)
        self.leader.committed(view, self.now)
        assert self.leader.view == view
        self.drain()

    @precondition(lambda self: self.now >= self.leader.grace_until and bool(self.leader.absent()))
    @rule(data=st.data(), answers=st.booleans())
    def probe(self, data: st.DataObject, answers: bool) -> None:
        member_id = data.draw(st.sampled_from(self.leader.absent()))
        if not answers:
            self.expected.add((member_id, Evidence.ABSENT))
        self.leader.probed(worker(member_id), answers, self.now)
        self.drain()

    @rule(seconds=st.sampled_from([HEARTBEAT, 0.5, 1.5, 3.0]))
    def time_passes(self, seconds: float) -> None:
        self.pass_time(seconds)

    @rule(seconds=st.sampled_from([1.0, 5.0, 12.0]))
    def etcd_does_not_answer(self, seconds: float) -> None:
        """etcd is down: no commit, no lease, no record reaches the leader;
        members heartbeat as ever, and the keep-alive asks which leases it
        would keep. Nobody alive is suspected for it."""
        before = set(self.removed)
        self.pass_time(seconds, leases=True)
        assert not (self.removed - before) & self.alive_with_sessions_before, (
            "a heartbeating member was evicted during an etcd outage"
        )

    @precondition(lambda self: bool(self.with_session()))
    @rule(late=st.sampled_from([0.5, 2.0, 10.0]))
    def leader_lags(self, late: float) -> None:
        """The shell woke up ``late`` seconds after it meant to: heartbeats
        of live members wait unread in its queues meanwhile."""
        planned = self.now + HEARTBEAT
        self.now = planned + late
        lagging = self.leader.woke(self.now, planned) is not None
        self.leader.tick(self.now)
        self.drain(lagging=lagging)
        for member_id in self.with_session():
            if member_id in self.alive:
                self.leader.heard(member_id, self.now)
                self.heard_at[member_id] = self.now
        self.leader.woke(self.now, None)

    def pass_time(self, seconds: float, leases: bool = False) -> None:
        self.alive_with_sessions_before = {i for i in self.with_session() if i in self.alive}
        end = self.now + seconds
        while self.now < end - 1e-9:
            planned = min(self.now + HEARTBEAT, end)
            self.now = planned
            for member_id in self.with_session():
                if member_id in self.alive:
                    self.leader.heard(member_id, self.now)
                    self.heard_at[member_id] = self.now
            self.leader.woke(self.now, planned)
            self.leader.tick(self.now)
            if leases:
                records = [i for i in self.issued if i not in self.removed]
                kept = self.leader.leases(records, self.now).member_ids
                assert set(kept) <= set(records)
                for member_id in self.with_session():
                    if member_id in self.alive and member_id not in kept:
                        raise AssertionError(f"the lease of heartbeating {member_id} dropped")
            self.drain()


LeaderMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_leader_machine = LeaderMachine.TestCase


# --- the heartbeat pace -----------------------------------------------------------


def test_the_heartbeat_interval_grows_with_the_view_and_new_detectors_start_with_it() -> None:
    config = CONFIG.replace(heartbeat_rate_max=40.0)  # 4 members at 0.1 s
    ids = tuple(f"m{n}" for n in range(4))
    leader = Leader(config, view_of(*ids), 0.0)
    assert leader.pace == config.heartbeat_interval
    for member_id in ids:
        leader.session_opened(member_id, 0.0)
    leader.take_actions()
    for n in range(8):  # four more join: 12 members need 0.3 s
        leader.joined(worker(f"j{n}"), 0.0)
        leader.session_opened(f"j{n}", 0.0)
    leader.tick(config.join_settle)
    (request,) = [a for a in leader.take_actions() if isinstance(a, RequestAnswers)]
    for member_id in request.member_ids:
        leader.answer(member_id, request.epoch, None, "", 0.1)
    (proposal,) = [a for a in leader.take_actions() if isinstance(a, CommitView)]

    leader.committed(proposal.view, 0.2)

    assert leader.pace == config.heartbeat_interval_for(12) == 0.3
    leader.session_opened("m0", 0.3)  # a reconnect starts over with the new interval
    assert leader.detector._detectors["m0"].mean_interval == 0.3
