"""The rendezvous replica: gRPC in front, etcd behind, the leader's pure
policy (``rollcall.membership.leader.Leader``, which owns the roll-call
``Coordinator`` and the ``FailureDetector``) in the middle.

One replica serves one job. Every replica answers ``Status`` and ``Watch``;
the one that holds the job's etcd election runs roll calls and serves
``Join``, ``Session`` and ``Leave``. All mutable state is owned by one asyncio
event loop, so no locks: etcd calls (blocking client) run in a small thread
pool and their results come back to the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from rollcall.membership.backoff import Backoff
from rollcall.membership.cause import CauseKind
from rollcall.membership.checkpoint import (
    CheckpointFailure,
    CheckpointManifest,
    durability,
    next_failure,
    progress_limit,
    stuck_since,
)
from rollcall.membership.config import Config
from rollcall.membership.continuity import Continuity, EtcdPosition
from rollcall.membership.coordinator import (
    CommitView,
    Coordinator,
    Refusal,
    RefusedClaim,
    ReportOutcome,
    RequestAnswers,
)
from rollcall.membership.credentials import SECRET_BYTES, epoch_secret, secret_hash, secret_matches
from rollcall.membership.errors import (
    ConfigurationMismatch,
    ControlPlaneUnavailable,
    Evicted,
    InvalidRequest,
    JobRecordLost,
    MalformedRecord,
    NoSuchJob,
    NotAMember,
    NotLeader,
    PermissionDenied,
    RollcallError,
    StaleEpoch,
)
from rollcall.membership.fingerprint import (
    JobActivity,
    JobFingerprint,
    Verdict,
    admit,
    describe_mismatch,
)
from rollcall.membership.leader import Evict, Evidence, Leader, PeerBusy, WriteProgress
from rollcall.membership.view import EMPTY_VIEW, Member, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol import validation as check
from rollcall.protocol.wire import (
    LEADER_METADATA,
    durability_to_pb,
    error_metadata,
    manifest_from_pb,
    manifest_to_pb,
    status_of,
    view_to_pb,
)
from rollcall.rendezvous.events import EventFile, EventLog, MemberReport
from rollcall.rendezvous.metrics import ServiceMetrics
from rollcall.rendezvous.probe import process_answers
from rollcall.rendezvous.store import EtcdStore, JobRecord, LeaderInfo, MemberRecord

log = logging.getLogger("rollcall.rendezvous")
T = TypeVar("T")

#: Longest free text (failure reasons) accepted from a member.
_MAX_REASON = 256
#: Largest duration a member may report (anything above is malformed).
_MAX_REPORTED_SECONDS = 1e6
#: Compare-and-swap rounds on the job's fingerprint before a join gives up.
_FINGERPRINT_ATTEMPTS = 5


@dataclass
class _Session:
    """An open session stream of one member on the leader."""

    member_id: str
    outbox: asyncio.Queue[pb.SessionEvent | RollcallError | None] = field(
        default_factory=asyncio.Queue
    )
    asked_epoch: int = 0  # last roll call sent on this session

    def send(self, event: pb.SessionEvent) -> None:
        self.outbox.put_nowait(event)

    def close(self, error: RollcallError | None = None) -> None:
        """End the stream: cleanly (None) or with the error's status."""
        self.outbox.put_nowait(error)


@dataclass
class _Leadership:
    """Everything that exists only while this replica is the leader."""

    info: LeaderInfo
    #: The leader's policy (it owns the coordinator and the detector).
    leader: Leader
    view_revision: int
    records: dict[str, MemberRecord]
    sessions: dict[str, _Session] = field(default_factory=dict)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = ""
    #: View commits under way (the view key may change under our own hand).
    committing: int = 0
    #: When etcd stopped answering this leader (None: it answers).
    unreachable_since: float | None = None
    #: The job's epoch key (etcd), from which each view's epoch secret is derived.
    epoch_key: str = ""
    #: Member id -> the hash of its secret (etcd's secrets/<id>), for members
    #: whose record is gone with an expired lease.
    secret_hashes: dict[str, str] = field(default_factory=dict)
    #: The events announcing the last view announced (``_view_events``),
    #: made once however many sessions receive them.
    announcing: tuple[View, tuple[pb.SessionEvent, pb.SessionEvent]] | None = None

    @property
    def coordinator(self) -> Coordinator:
        return self.leader.coordinator


class Replica(pb_grpc.RendezvousServicer):
    """One rendezvous replica for one job."""

    def __init__(
        self,
        store: EtcdStore,
        job: str,
        advertise: str,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        events: EventFile | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self._store = store
        self._job = job
        self._advertise = advertise
        self._config = config
        self._clock = clock
        self.replica_id = f"{advertise}-{secrets.token_hex(3)}"
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="etcd")
        self._lead: _Leadership | None = None
        self._latest_view: View = EMPTY_VIEW
        self._view_changed = asyncio.Condition()
        self._leader_changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._cancel_watches: list[Callable[[], None]] = []
        self._events = EventLog(job, time.time() - clock(), config)
        self._event_file = events
        self._metrics = metrics
        #: Held from a fingerprinted joiner's check to its record: a job
        #: that looks empty to one must not take another run's meanwhile.
        self._admitting = asyncio.Lock()
        #: Why this replica last refused to lead ("" once it leads).
        self._refusal = ""
        #: The highest etcd position this replica has seen, and the job's
        #: record as last read or written, to detect and repair lost data.
        self._continuity = Continuity()
        self._remembered: JobRecord | None = None
        self._loss_said = ""
        #: The job's durability failure (as recorded in etcd, or newer), and
        #: when it was last written there (written at most every
        #: progress_write_interval; the events follow the writes).
        self._failure: CheckpointFailure | None = None
        self._failure_written = -float("inf")

    # --- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_view(view: View) -> None:
            loop.call_soon_threadsafe(self._observe_stored_view, view)

        def on_leader(_: LeaderInfo | None) -> None:
            loop.call_soon_threadsafe(self._leader_changed.set)

        self._cancel_watches.append(self._store.watch_view(on_view))
        self._cancel_watches.append(self._store.watch_leader(on_leader))
        self._tasks.append(asyncio.create_task(self._campaign_forever(), name="campaign"))
        self._tasks.append(asyncio.create_task(self._poll_view_forever(), name="poll-view"))

    async def stop(self) -> None:
        """Step down (resigning the election so a standby takes over at once)."""
        self._stopping = True
        lead = self._lead
        if lead is not None:
            self._lose(lead, "replica shutting down")
            try:
                await self._etcd(self._store.resign, lead.info)
            except ControlPlaneUnavailable:
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cancel in self._cancel_watches:
            cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_leader(self) -> bool:
        return self._lead is not None

    async def _etcd(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- election ------------------------------------------------------------

    async def _campaign_forever(self) -> None:
        backoff = Backoff(self._config.client_retry_initial, self._config.client_retry_max)
        while not self._stopping:
            try:
                info = await self._etcd(self._store.campaign, self.replica_id, self._advertise)
            except ControlPlaneUnavailable as exc:
                log.warning("%s", exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            if info is None:
                self._leader_changed.clear()
                try:
                    await asyncio.wait_for(
                        self._leader_changed.wait(), timeout=self._config.election_ttl / 2
                    )
                except TimeoutError:
                    pass
                continue
            try:
                await self._serve_as_leader(info)
            except MalformedRecord as exc:
                await self._refuse_to_lead(info, exc)
            except ControlPlaneUnavailable as exc:
                log.warning("giving up leadership: %s", exc)
                if self._lead is not None:
                    self._lose(self._lead, str(exc))
            finally:
                self._lead = None

    async def _refuse_to_lead(self, info: LeaderInfo, error: MalformedRecord) -> None:
        """etcd holds something this replica cannot lead with (the job's
        view is malformed): say so once, give the election back, and look
        again after ``refusal_retry``."""
        if str(error) != self._refusal:
            self._refusal = str(error)
            log.error(
                "replica %s refuses to lead job %s: %s; the workers keep training, but no "
                "view can change until the key holds a valid view or is deleted",
                self._advertise, self._job, error,
            )  # fmt: skip
        try:
            await self._etcd(self._store.resign, info)
        except ControlPlaneUnavailable:
            pass  # the election lease expires by itself
        await asyncio.sleep(self._config.refusal_retry)

    async def _serve_as_leader(self, info: LeaderInfo) -> None:
        record = await self._take_over_record(info)
        view, revision = record.view, record.view_revision
        self._refusal = ""
        records = {r.member.id: r for r in await self._etcd(self._store.list_members)}
        checkpoints = record.checkpoints
        epoch_key = await self._etcd(self._store.epoch_key)
        # Secret hashes outlive the records (which expire with their leases
        # when etcd cannot keep them alive): the members of the view that
        # reconnect without a record are still recognised.
        hashes = await self._etcd(self._store.list_secret_hashes)
        hashes = {i: h for i, h in hashes.items() if i in view or i in records}
        self._events.checkpoint_step = checkpoints[0].step if checkpoints else None
        self._failure = await self._etcd(self._store.read_checkpoint_failure)
        if self._metrics is not None:
            self._metrics.leader.set(1)
            self._metrics.durable_step.set(checkpoints[0].step if checkpoints else -1)
            self._metrics.durability_stuck.set(
                stuck_since(self._failure, self._events.checkpoint_step)
            )
        now = self._clock()
        joiners = [r.member for r in records.values() if r.member.id not in view]
        lead = _Leadership(
            info=info,
            leader=Leader(self._config, view, now, joiners),
            view_revision=revision,
            records=records,
            epoch_key=epoch_key,
            secret_hashes=hashes,
        )
        self._lead = lead
        self._observe_view(view)
        log.info(
            "replica %s leads job %s at epoch %d (%d members, %d joining)",
            self._advertise,
            self._job,
            view.epoch,
            view.size,
            len(joiners),
        )
        self._drain(lead)
        tasks = [
            asyncio.create_task(self._drive(lead), name="drive"),
            asyncio.create_task(self._keep_alive(lead), name="keep-alive"),
            asyncio.create_task(self._record_progress(lead), name="progress"),
            asyncio.create_task(self._account_for_absent(lead), name="absent"),
        ]
        try:
            await lead.lost.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for session in list(lead.sessions.values()):
                session.close(NotLeader(f"replica lost leadership: {lead.lost_reason}"))
            lead.sessions.clear()
            self._emit(self._events.flush())
            if self._metrics is not None:
                self._metrics.leader.set(0)
            log.info("replica %s stepped down: %s", self._advertise, lead.lost_reason)

    def _lose(self, lead: _Leadership, reason: str) -> None:
        if not lead.lost.is_set():
            lead.lost_reason = reason
            lead.lost.set()

    async def _keep_alive(self, lead: _Leadership) -> None:
        """Every third of the shortest TTL: check that etcd still holds the
        job's history, hold the election, keep the members' leases alive.
        While etcd does not answer, nothing is decided: sessions stay open,
        heartbeats are acknowledged and training goes on."""
        period = min(self._config.election_ttl, self._config.member_lease_ttl) / 3
        while True:
            try:
                if not await self._hold_leadership(lead):
                    return
                await self._keep_members(lead)
                self._answered_again(lead)
                self._emit(self._events.tick(self._clock()))
            except ControlPlaneUnavailable as exc:
                self._unreachable(lead, exc)
            await asyncio.sleep(period)

    # --- etcd outages and lost data --------------------------------------------

    async def _hold_leadership(self, lead: _Leadership) -> bool:
        """One keep-alive round's checks of etcd; False once this replica
        no longer leads. Its election lease having expired is no reason to
        step down (etcd could not keep it alive: a stall, or this replica
        could not reach it for longer than its TTL): if nobody took over,
        it takes the election again and keeps every session."""
        record, position = await self._etcd(self._store.read_job)
        if record.view_revision != lead.view_revision:
            # Not the view this leader committed (only the leader commits):
            # one written behind its back (``_guard_view`` puts its own back)
            # says nothing about how far the job got, so a higher epoch in
            # it must not count as history that a restore would then "lose".
            mine = lead.coordinator.view.epoch
            position = dataclasses.replace(position, epoch=min(position.epoch, mine))
        lost = self._continuity.lost(position)
        if lost is not None:
            return await self._restore_in_place(lead, record, position, lost)
        self._continuity.advance(position)
        self._remember(
            fingerprint=record.fingerprint, checkpoints=record.checkpoints, progress=record.progress
        )
        if await self._etcd(self._store.refresh_leader, lead.info):
            return True
        info = await self._etcd(
            self._store.reclaim_leadership, self.replica_id, self._advertise, lead.view_revision
        )
        if info is None:
            self._lose(lead, "election lease lost: another replica leads now")
            return False
        lead.info = info
        log.warning(
            "replica %s: its election lease expired while etcd could not keep it alive and "
            "nobody took over: it leads again at epoch %d, keeping its %d sessions",
            self._advertise, lead.coordinator.view.epoch, len(lead.sessions),
        )  # fmt: skip
        return True

    async def _keep_members(self, lead: _Leadership) -> None:
        """Keep the leases of members that deserve it alive; record again
        those whose lease etcd let expire or whose record is gone while
        their session is alive (that is etcd's failure, not theirs)."""
        deserving = lead.leader.leases(lead.records, self._clock())
        leases = {lead.records[member_id].lease_id: member_id for member_id in deserving.member_ids}
        remaining = await self._etcd(self._store.keep_alive, list(leases))
        again = [leases[lease_id] for lease_id, ttl in remaining.items() if ttl <= 0]
        again += [m for m in lead.sessions if m not in lead.records]
        if again:
            await self._register_again(lead, again)

    async def _register_again(self, lead: _Leadership, member_ids: list[str]) -> None:
        done = []
        for member_id in member_ids:
            member = self._member_of(lead, member_id)
            if member is None:
                continue
            old = lead.records.get(member_id)
            hashed = (old.secret_hash if old else "") or lead.secret_hashes.get(member_id, "")
            record = await self._etcd(self._store.register_again, member, hashed)
            if lead.lost.is_set() or not lead.coordinator.knows(member_id):
                # Suspected or gone meanwhile: the new record is not wanted.
                asyncio.create_task(self._remove_record(record))
                continue
            lead.records[member_id] = record
            done.append(member_id)
        if done:
            log.warning(
                "recorded %d members again under new etcd leases (their leases expired or "
                "their records were gone while their sessions stayed alive): %s",
                len(done), ", ".join(done),
            )  # fmt: skip

    @staticmethod
    def _member_of(lead: _Leadership, member_id: str) -> Member | None:
        record = lead.records.get(member_id)
        if record is not None:
            return record.member
        coordinator = lead.coordinator
        candidates = coordinator.rollcall.candidates if coordinator.rollcall else ()
        for member in (*coordinator.view.members, *coordinator.pending_joiners, *candidates):
            if member.id == member_id:
                return member
        return None

    def _unreachable(self, lead: _Leadership, exc: ControlPlaneUnavailable) -> None:
        if lead.unreachable_since is None:
            lead.unreachable_since = self._clock()
            log.warning(
                "etcd does not answer (%s): sessions stay open and training goes on; view "
                "changes and the progress record wait until it answers again", exc,
            )  # fmt: skip
        else:
            log.debug("etcd still does not answer: %s", exc)

    def _answered_again(self, lead: _Leadership) -> None:
        if lead.unreachable_since is not None:
            log.warning(
                "etcd answers again after %.1f s: nobody was evicted for it",
                self._clock() - lead.unreachable_since,
            )
            lead.unreachable_since = None

    async def _account_for_absent(self, lead: _Leadership) -> None:
        """After the takeover grace, members of the inherited view that did
        not reconnect: one whose process does not answer at its address is
        suspected; one whose process answers is alive and most likely still
        held by the previous leader, cut off from etcd (it keeps its
        sessions until it reaches etcd and finds it lost the election), so
        it is not evicted: roll calls wait for it, and it is asked again
        every takeover grace."""
        leader = lead.leader
        await asyncio.sleep(max(0.0, leader.grace_until - self._clock()))
        while lead.coordinator.awaiting:
            for member_id in leader.absent():
                member = self._member_of(lead, member_id)
                if member is None or member_id in lead.sessions:
                    continue
                answers = await process_answers(member.address, self._config.member_probe_timeout)
                if leader.probed(member, answers, self._clock()):
                    log.warning(
                        "%s did not reconnect within the takeover grace, but its process "
                        "answers at %s: it is alive (probably still held by a replica cut "
                        "off from etcd), not evicted; roll calls wait for it",
                        member_id, member.address,
                    )  # fmt: skip
                elif not answers:
                    self._drain(lead)  # suspected, unless it reconnected meanwhile
            await asyncio.sleep(self._config.takeover_grace)

    def _remember(self, **changes: Any) -> None:
        """Update this replica's memory of the job's record (what it would
        write back if etcd lost it); ``None`` values change nothing."""
        known = self._remembered or JobRecord(EMPTY_VIEW, 0, None, None, ())
        updates = {k: v for k, v in changes.items() if v is not None}
        self._remembered = dataclasses.replace(known, **updates)

    def _record_of(self, lead: _Leadership) -> JobRecord:
        """The job's record as the leader knows it now."""
        view = lead.coordinator.view
        known = self._remembered or JobRecord(EMPTY_VIEW, 0, None, None, ())
        step = lead.leader.step
        progress = (view.epoch, step) if step is not None else known.progress
        return dataclasses.replace(known, view=view, view_revision=lead.view_revision,
                                   progress=progress)  # fmt: skip

    def _follow_record(self, record: JobRecord, position: EtcdPosition) -> None:
        """A standby's poll: remember the record, or say once that etcd lost it."""
        lost = self._continuity.lost(position)
        if lost is not None:
            if self._loss_said != lost:
                self._loss_said = lost
                log.error(
                    "etcd lost job %s's data (%s): the leader writes back what it remembers; "
                    "this replica remembers epoch %d", self._job, lost, self._continuity.epoch,
                )  # fmt: skip
            return
        self._continuity.advance(position)
        self._remember(view=record.view, view_revision=record.view_revision,
                       progress=record.progress, fingerprint=record.fingerprint,
                       checkpoints=record.checkpoints)  # fmt: skip
        self._observe_view(record.view)

    async def _take_over_record(self, info: LeaderInfo) -> JobRecord:
        """The job's record for a replica that just won the election: what
        etcd holds, or, if etcd lost the history this replica saw, what the
        replica remembers, written back first."""
        record, position = await self._etcd(self._store.read_job)
        lost = self._continuity.lost(position)
        known = self._remembered
        if lost is None or known is None or known.view.epoch <= record.view.epoch:
            if lost is not None:
                log.error("etcd's history of job %s changed (%s); it holds epoch %d, which "
                          "this replica follows", self._job, lost, record.view.epoch)  # fmt: skip
            if lost is None:
                self._continuity.advance(position)
            else:
                self._continuity.rebase(position)
            self._remember(view=record.view, view_revision=record.view_revision,
                           progress=record.progress, fingerprint=record.fingerprint,
                           checkpoints=record.checkpoints)  # fmt: skip
            return record
        revision = await self._etcd(self._store.restore_job, known, record.view_revision, info)
        if revision is None:
            raise ControlPlaneUnavailable(
                "etcd lost the job's data and another replica wrote it first"
            )
        await self._after_restore(known, lost, revision)
        return dataclasses.replace(known, view_revision=revision)

    async def _restore_in_place(
        self, lead: _Leadership, found: JobRecord, position: EtcdPosition, lost: str
    ) -> bool:
        """etcd lost the history this leader saw: write back the job's
        record from memory (view, progress, fingerprint, checkpoint
        manifests) and lead on with every session; the workers notice
        nothing. False (stepping down) when etcd holds a newer view than
        ours, or another replica leads there already."""
        known = self._record_of(lead)
        if found.view.epoch >= known.view.epoch:
            self._continuity.rebase(position)
            self._lose(lead, f"etcd's history changed ({lost}) and it holds epoch "
                             f"{found.view.epoch}")  # fmt: skip
            return False
        info = lead.info
        if not await self._etcd(self._store.refresh_leader, info):
            taken = await self._etcd(self._store.campaign, self.replica_id, self._advertise)
            if taken is None:
                log.error("etcd lost job %s's data (%s), and another replica leads it there "
                          "already: stepping down", self._job, lost)  # fmt: skip
                self._lose(lead, "etcd lost the job's data; another replica leads")
                return False
            info = taken
        revision = await self._etcd(self._store.restore_job, known, found.view_revision, info)
        if revision is None:
            self._lose(lead, "etcd lost the job's data; another replica wrote it first")
            return False
        lead.info, lead.view_revision = info, revision
        await self._after_restore(known, lost, revision)
        return True

    async def _after_restore(self, known: JobRecord, lost: str, revision: int) -> None:
        _, position = await self._etcd(self._store.read_job)
        self._continuity.rebase(position)
        self._remember(view=known.view, view_revision=revision)
        self._loss_said = ""
        step = known.progress[1] if known.progress is not None else None
        log.error(
            "etcd lost job %s's data (%s): wrote back from this replica's memory the view "
            "(epoch %d, %d members), the progress record (step %s), %s and %d checkpoint "
            "manifests; training goes on",
            self._job, lost, known.view.epoch, known.view.size, step,
            "the fingerprint" if known.fingerprint is not None else "no fingerprint",
            len(known.checkpoints),
        )  # fmt: skip

    def _ahead(self, lead: _Leadership, member_id: str, epoch: int) -> RollcallError:
        """The error for a member's message whose epoch is ahead of this
        leader's view: this replica is behind (another one committed that
        epoch), the message is malformed (a member it knows cannot be
        ahead), or, from a member it has never heard of, etcd lost the view
        the member is in and no replica remembers it."""
        committed = lead.coordinator.view.epoch
        if epoch <= self._continuity.epoch:
            return NotLeader(
                f"replica {self._advertise} is behind epoch {epoch} (it holds {committed}): "
                "it no longer leads"
            )
        if lead.coordinator.knows(member_id):
            return InvalidRequest(f"epoch {epoch} is ahead of the committed epoch {committed}")
        return JobRecordLost(
            f"member {member_id} is at epoch {epoch}, but etcd holds job {self._job} at epoch "
            f"{committed} and this replica never saw a later one: etcd lost the job's data "
            "(wiped, replaced or restored from an old backup) and no replica remembered it. "
            "This worker's state is intact but cannot rejoin under its old id: restart the "
            "job's workers"
        )

    # --- the roll-call driver -------------------------------------------------

    async def _drive(self, lead: _Leadership) -> None:
        """Let time pass for the leader's policy (``Leader.tick``), waking
        when it has work to do or an event arrived, and tell it when this
        loop woke up late (``Leader.woke``: suspicions wait a round)."""
        leader = lead.leader
        while True:
            now = self._clock()
            leader.tick(now)
            self._drain(lead)
            wakeup = leader.next_wakeup(now)
            timeout = min(max(0.0, (wakeup if wakeup is not None else now + 1.0) - now), 1.0)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                leader.woke(self._clock(), None)
            except TimeoutError:
                late = leader.woke(self._clock(), now + timeout)
                if late is not None:
                    log.warning("replica lagging by %.0f ms: suspicions deferred", late * 1000)

    def _drain(self, lead: _Leadership) -> None:
        """Carry out the leader's actions."""
        for action in lead.leader.take_actions():
            if isinstance(action, RequestAnswers):
                self._events.rollcall(self._clock())
                for member_id in action.member_ids:
                    session = lead.sessions.get(member_id)
                    if session is not None:
                        self._ask(session, action.epoch)
            elif isinstance(action, CommitView):
                for claim in action.refused:
                    self._log_refused(action.view, claim)
                asyncio.create_task(
                    self._counted_commit(lead, action), name=f"commit-{action.view.epoch}"
                )
            elif isinstance(action, Evict):
                self._evict(lead, action)
            elif isinstance(action, PeerBusy):
                self._tell_busy(lead, action)
            else:
                asyncio.create_task(self._flush_progress(lead, action))
        self._wake.set()

    @staticmethod
    def _log_refused(view: View, claim: RefusedClaim) -> None:
        """A roll-call answer whose step the view does not resume from."""
        if claim.why is Refusal.AHEAD:
            log.warning(
                "roll call %d: %s claims step %d, more than one step ahead of the job's "
                "recorded progress (%s): not believed; it fetches step %s from the others",
                view.epoch, claim.member_id, claim.step, claim.bound, view.resume_step,
            )  # fmt: skip
        else:
            log.warning(
                "roll call %d: joiner %s claims step %d: a joiner's state is never adopted; "
                "it fetches step %s from the survivors",
                view.epoch, claim.member_id, claim.step, view.resume_step,
            )  # fmt: skip

    def _emit(self, records: list[dict[str, Any]]) -> None:
        """Write finished event records to the events file and the metrics."""
        for record in records:
            if self._metrics is not None:
                self._metrics.record(record)
        if self._event_file is not None and records:
            try:
                self._event_file.write(records)
            except OSError as exc:
                log.warning("events file %s: %s", self._event_file.path, exc)

    def _ask(self, session: _Session, epoch: int) -> None:
        if session.asked_epoch >= epoch:
            return
        session.asked_epoch = epoch
        lead = self._lead
        causes = lead.coordinator.rollcall.causes if lead and lead.coordinator.rollcall else ()
        request = pb.RollCallRequest(epoch=epoch, causes=[str(c) for c in causes])
        session.send(pb.SessionEvent(roll_call=request))

    async def _counted_commit(self, lead: _Leadership, action: CommitView) -> None:
        lead.committing += 1
        try:
            await self._commit(lead, action)
        finally:
            lead.committing -= 1

    async def _commit(self, lead: _Leadership, action: CommitView) -> None:
        backoff = Backoff(self._config.client_retry_initial, self._config.client_retry_max)
        while not lead.lost.is_set():
            try:
                committed = await self._etcd(
                    self._store.commit_view, action.view, lead.view_revision, lead.info
                )
                if committed is None:
                    # The comparison failed. Our own earlier attempt may have
                    # landed with its answer lost; the view untouched means
                    # only our election lease lapsed (the keep-alive takes it
                    # again or steps down), a view older than ours that etcd
                    # lost it (the keep-alive restores it); someone who is not
                    # the leader may have written the key; anything else
                    # means another replica leads now.
                    current, revision, malformed = await self._etcd(self._store.read_stored_view)
                    if current != action.view:
                        if current is not None and (
                            revision == lead.view_revision
                            or current.epoch < action.previous.epoch
                        ):
                            await asyncio.sleep(backoff.next())
                            continue
                        if not await self._written_behind_our_back(lead, current, malformed):
                            what = malformed or f"epoch {current.epoch if current else '?'}"
                            self._lose(lead, f"view CAS failed: etcd holds {what}")
                            return
                        lead.view_revision = revision
                        continue
                else:
                    revision = committed
                break
            except ControlPlaneUnavailable as exc:
                log.warning("commit of epoch %d waits: %s", action.view.epoch, exc)
                await asyncio.sleep(backoff.next())
        else:
            return
        lead.view_revision = revision
        now = self._clock()
        lead.leader.committed(action.view, now)
        causes = ", ".join(str(c) for c in action.causes[:8]) + (
            f" and {len(action.causes) - 8} more" if len(action.causes) > 8 else ""
        )
        log.info("committed epoch %d: %d members (%s)", action.view.epoch, action.view.size, causes)
        self._emit(self._events.committed(action.view, action.previous, action.causes, now))
        if self._metrics is not None:
            self._metrics.epoch.set(action.view.epoch)
            self._metrics.members.set(action.view.size)
        self._observe_view(action.view)
        self._announce(lead, action.view)
        self._drain(lead)

    async def _written_behind_our_back(
        self, lead: _Leadership, stored: View | None, malformed: str
    ) -> bool:
        """Whether the view key changed while this replica still holds the
        election (so no other replica can have committed it): then it was
        written by someone else, which is said, and the leader's own views
        go on over it."""
        if await self._etcd(self._store.read_leader) != lead.info:
            return False
        if stored is None:
            what = f"a malformed value: {malformed}"
        else:
            what = f"epoch {stored.epoch}, members {', '.join(stored.ids) or 'none'}"
        log.warning(
            "the view of job %s in etcd was not written by this job's leader (%s): ignored; "
            "the leader keeps epoch %d and writes its views over it",
            self._job, what, lead.coordinator.view.epoch,
        )  # fmt: skip
        return True

    async def _guard_view(self, lead: _Leadership) -> None:
        """Put the leader's view back if someone else wrote the view key
        (only the leader commits views): members and clients must never be
        told of a view this leader did not decide."""
        if lead.committing:
            return  # the key may be changing under our own commit
        stored, revision, malformed = await self._etcd(self._store.read_stored_view)
        if lead.lost.is_set() or lead.committing or revision == lead.view_revision:
            return
        if not await self._written_behind_our_back(lead, stored, malformed):
            return
        restored = await self._etcd(
            self._store.commit_view, lead.coordinator.view, revision, lead.info
        )
        if restored is not None and not lead.committing:
            lead.view_revision = restored
    def _view_events(
        self, lead: _Leadership, view: View
    ) -> tuple[pb.SessionEvent, pb.SessionEvent]:
        """The events announcing ``view``: its epoch secret (for its members
        only) and the view itself."""
        if lead.announcing is not None and lead.announcing[0] == view:
            return lead.announcing[1]
        secret = epoch_secret(lead.epoch_key, self._job, view)
        events = (
            pb.SessionEvent(epoch_secret=pb.EpochSecret(epoch=view.epoch, secret=secret)),
            pb.SessionEvent(view=view_to_pb(view)),
        )
        lead.announcing = (view, events)
        return events

    @staticmethod
    def _send_view(
        session: _Session, view: View, events: tuple[pb.SessionEvent, pb.SessionEvent]
    ) -> None:
        """Send a view on ``session``, preceded by its epoch secret if the
        session's member is in it (never to anyone else)."""
        secret, announcement = events
        if session.member_id in view:
            session.send(secret)
        session.send(announcement)

    def _announce(self, lead: _Leadership, view: View) -> None:
        """Send a committed view on every session (members it removes are
        evicted after it: ``Evict`` actions)."""
        events = self._view_events(lead, view)
        for session in list(lead.sessions.values()):
            self._send_view(session, view, events)

    def _evict(self, lead: _Leadership, action: Evict) -> None:
        """The one way a member leaves the leader's books (it left, was
        suspected, or lost its place in a view): its session ends (cleanly
        when it left) and its etcd record is removed."""
        member_id = action.member_id
        if action.cause is None:
            ending: RollcallError | None = Evicted(
                f"member {member_id} is not in view {action.epoch}; rejoin"
            )
        elif action.cause.kind is CauseKind.LEAVE:
            ending = None
        else:
            if action.counted:
                log.info("suspect %s: %s", member_id, action.reason)
                kind = "crash" if action.evidence is Evidence.STREAM_BROKEN else "suspected"
                self._events.cause(self._clock(), kind, action.silence_s)
            ending = Evicted(f"member {member_id} suspected ({action.reason}); rejoin")
        session = lead.sessions.pop(member_id, None)
        if session is not None:
            session.close(ending)
        record = lead.records.pop(member_id, None)
        if record is not None:
            asyncio.create_task(self._remove_record(record))

    async def _remove_record(self, record: MemberRecord) -> None:
        try:
            await self._etcd(self._store.remove_member, record.member.id, record.lease_id)
        except ControlPlaneUnavailable:
            pass  # not kept alive any more: the lease expires on its own

    def _on_report(
        self, lead: _Leadership, member_id: str, report: pb.FailureReport, now: float
    ) -> None:
        """A member's failure report of the view in force: a roll call,
        within the member's limit (``Config.report_burst``)."""
        outcome = lead.leader.report(member_id, report.peer_id, now)
        if outcome is ReportOutcome.ROLL_CALL:
            self._events.cause(now, "report")
            log.info("%s reports %s failing: %s", member_id, report.peer_id, report.reason)
            self._drain(lead)
        elif outcome is ReportOutcome.LIMITED:
            log.warning(
                "%s sends more failure reports than its limit (%d roll calls in a row, then one "
                "per %g s, Config.report_burst): ignored until it is within it again",
                member_id, self._config.report_burst, self._config.report_interval,
            )  # fmt: skip

    def _tell_busy(self, lead: _Leadership, action: PeerBusy) -> None:
        """A member's busy period began or ended: the other members' collectives wait for it."""
        member_id = action.member_id
        if action.seconds > 0:
            log.info("%s busy (%s) for up to %.0f s", member_id, action.reason or "no reason",
                     action.seconds)  # fmt: skip
        else:
            if action.overran:
                log.warning("%s is still busy past the period it declared", member_id)
            log.info("%s no longer busy", member_id)
        event = pb.SessionEvent(
            busy=pb.PeerBusy(member_id=member_id, seconds=action.seconds, reason=action.reason)
        )
        for other, session in lead.sessions.items():
            if other != member_id:
                session.send(event)

    async def _put_progress(self, lead: _Leadership, write: WriteProgress) -> None:
        if await self._etcd(self._store.write_progress_as, lead.info, write.epoch, write.step):
            lead.leader.progress_written(write.epoch, write.step)

    async def _flush_progress(self, lead: _Leadership, write: WriteProgress) -> None:
        """The last step of a view that is being replaced, whatever the rate."""
        try:
            await self._put_progress(lead, write)
        except ControlPlaneUnavailable as exc:
            log.warning("progress of epoch %d not recorded: %s", write.epoch, exc)

    async def _record_progress(self, lead: _Leadership) -> None:
        """The current view's last step, every progress_write_interval when
        it changed. A write that etcd does not answer is retried with the
        step current then, so the record is current again within an
        interval of etcd answering (and of this replica leading again)."""
        while True:
            due = lead.leader.progress_due()
            if due is not None:
                try:
                    await self._put_progress(lead, due)
                except ControlPlaneUnavailable:
                    pass  # the keep-alive says that etcd does not answer
            await asyncio.sleep(self._config.progress_write_interval)

    # --- views seen by every replica -------------------------------------------

    def _observe_stored_view(self, view: View) -> None:
        """A view seen in etcd. The leader knows its own views first-hand
        and ignores the key (``_guard_view`` puts it back if someone else
        wrote it)."""
        if self._lead is None:
            self._observe_view(view)

    def _observe_view(self, view: View) -> None:
        self._continuity.saw_epoch(view.epoch)
        if view.epoch <= self._latest_view.epoch and self._latest_view is not EMPTY_VIEW:
            return
        self._latest_view = view

        async def notify() -> None:
            async with self._view_changed:
                self._view_changed.notify_all()

        asyncio.ensure_future(notify())

    async def _poll_view_forever(self) -> None:
        """Backstop for the etcd watch (which is lost while etcd is down),
        and the standby's memory of the job's record (``_remember``)."""
        while True:
            try:
                lead = self._lead
                if lead is None:
                    record, position = await self._etcd(self._store.read_job)
                    self._follow_record(record, position)
                else:
                    await self._guard_view(lead)
            except ControlPlaneUnavailable:
                pass
            await asyncio.sleep(self._config.view_poll_interval)

    # --- request checks -----------------------------------------------------------

    def _check_job(self, job: str) -> None:
        check.check_id(job, "job", self._config)
        if job != self._job:
            raise NoSuchJob(f"no such job {job!r}: this service serves job {self._job!r}")

    def _leader(self) -> _Leadership:
        lead = self._lead
        if lead is None:
            raise NotLeader(
                f"replica {self._advertise} is not the leader of job {self._job}",
                leader=None,
            )
        return lead

    def _fence(self, lead: _Leadership, member_id: str, epoch: int) -> None:
        """Reject a member that may no longer act: unknown ids, and senders
        of an old epoch that are not in the view in force."""
        check.check_counter(epoch, "epoch")
        view = lead.coordinator.view
        if epoch > view.epoch:
            raise self._ahead(lead, member_id, epoch)
        if lead.coordinator.knows(member_id):
            return
        if epoch < view.epoch:
            raise StaleEpoch(
                f"epoch {epoch} is stale: member {member_id} is not in view {view.epoch}; rejoin"
            )
        raise NotAMember(f"member {member_id!r} is not a member of job {self._job}")

    def _authenticate(self, lead: _Leadership, member_id: str, presented: str) -> None:
        """Refuse a request naming ``member_id`` that does not carry its
        member secret (checked against the hash in its record)."""
        record = lead.records.get(member_id)
        expected = record.secret_hash if record is not None else ""
        if not secret_matches(presented, expected or lead.secret_hashes.get(member_id, "")):
            raise PermissionDenied(
                f"request for member {member_id} without its member secret: refused "
                "(a member's calls carry the secret its Join answer gave it)"
            )

    async def _abort(self, context: grpc.aio.ServicerContext, error: RollcallError) -> None:
        metadata = error_metadata(error)
        if isinstance(error, NotLeader):
            leader = await self._known_leader()
            if leader:
                metadata += ((LEADER_METADATA, leader),)
        if metadata:
            context.set_trailing_metadata(metadata)
        await context.abort(status_of(error), str(error))

    async def _known_leader(self) -> str:
        try:
            info = await asyncio.wait_for(
                self._etcd(self._store.read_leader), timeout=self._config.etcd_timeout
            )
        except (ControlPlaneUnavailable, TimeoutError):
            return ""
        return info.address if info is not None else ""

    # --- RPCs -------------------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_job(request.job)
            check.check_address(request.address, self._config)
            name = request.name or "w"
            check.check_id(name, "name", self._config)
            fingerprint = check.check_fingerprint(request.fingerprint)
            member = Member(f"{name[: self._config.max_id_length - 9]}-{secrets.token_hex(4)}",
                            request.address)  # fmt: skip
            secret = secrets.token_hex(SECRET_BYTES)
            lead = self._leader()
            if fingerprint is None:  # not checked: operator tools, lightweight members
                await self._enrol(lead, member, secret)
            else:
                async with self._admitting:
                    await self._admit(lead, fingerprint, request.address)
                    await self._enrol(lead, member, secret)
            log.info("join %s at %s", member.id, request.address)
            return pb.JoinResponse(
                member_id=member.id,
                view=view_to_pb(lead.coordinator.view),
                heartbeat_interval_ms=round(self._config.heartbeat_interval * 1000),
                earliest_suspicion_s=self._config.earliest_suspicion(),
                member_secret=secret,
            )
        except RollcallError as error:
            await self._abort(context, error)

    async def _enrol(self, lead: _Leadership, member: Member, secret: str) -> None:
        """Record a joiner (with the hash of its secret) in etcd and hand it
        to the coordinator."""
        record = await self._etcd(self._store.add_member, member, secret_hash(secret))
        if lead.lost.is_set():
            raise NotLeader("replica lost leadership during the join")
        now = self._clock()
        lead.records[member.id] = record
        lead.leader.joined(record.member, now)
        self._events.cause(now, "join")
        self._drain(lead)

    async def _admit(self, lead: _Leadership, fingerprint: JobFingerprint, address: str) -> None:
        """Check a joiner's fingerprint against the job's (``membership.
        fingerprint.admit``): record it if the job has none, replace the
        job's if the job is empty and has never trained, else raise
        ``ConfigurationMismatch``, having changed nothing."""
        for _ in range(_FINGERPRINT_ATTEMPTS):
            stored = await self._etcd(self._store.read_fingerprint)
            if stored.malformed:
                log.warning(
                    "job %s: the fingerprint stored in etcd is malformed (%s): ignored, "
                    "this joiner's replaces it", self._job, stored.malformed,
                )  # fmt: skip
            view = lead.coordinator.view
            activity = JobActivity(
                members=view.size,
                joiners=sum(1 for member_id in lead.records if member_id not in view),
                progress=stored.progress or lead.leader.trained,
                checkpoints=stored.checkpoints,
            )
            admission = admit(fingerprint, stored.fingerprint, activity)
            if admission.verdict is Verdict.MATCHES:
                self._remember(fingerprint=fingerprint.as_dict())
                return
            if admission.verdict is Verdict.REFUSE:
                refusal = describe_mismatch(self._job, admission.differences)
                log.info("join from %s refused: %s", address, refusal)
                raise ConfigurationMismatch(refusal)
            if not await self._etcd(self._store.record_fingerprint, fingerprint, stored.revision):
                continue  # another writer got in between: decide again
            self._remember(fingerprint=fingerprint.as_dict())
            if admission.verdict is Verdict.REPLACE:
                changes = (f"{d.name} {d.job} -> {d.joiner}" for d in admission.differences)
                changed = ", ".join(changes)
                log.info(
                    "job %s is empty and has never trained: its fingerprint is replaced by "
                    "a new run's (%s)", self._job, changed,
                )  # fmt: skip
            else:
                log.info("job %s: fingerprint recorded (%d fields)", self._job, len(fingerprint))
            return
        raise ControlPlaneUnavailable("job fingerprint: too much contention on etcd")

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_job(request.job)
            check.check_id(request.member_id, "member_id", self._config)
            lead = self._leader()
            self._fence(lead, request.member_id, request.epoch)
            self._authenticate(lead, request.member_id, request.member_secret)
            now = self._clock()
            lead.leader.leave(request.member_id, now)
            self._events.cause(now, "leave")
            log.info("leave %s", request.member_id)
            self._drain(lead)
            return pb.LeaveResponse()
        except RollcallError as error:
            await self._abort(context, error)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_job(request.job)
            if self._lead is not None:  # its own view, whatever the key holds
                view = self._lead.coordinator.view
            else:
                view, _ = await self._etcd(self._store.read_view)
            leader = await self._etcd(self._store.read_leader)
            checkpoints = await self._etcd(self._store.read_checkpoints)
            lead = self._lead
            leading = lead is not None and lead.coordinator.view.epoch == view.epoch
            step = lead.leader.step if lead is not None and leading else None
            progress = None
            if step is None:  # etcd's record: another replica leads, or none yet
                progress = await self._etcd(self._store.read_progress)
                if not leading:
                    step = (
                        progress[1] if progress and progress[0] == view.epoch else view.resume_step
                    )
            response = pb.StatusResponse(
                view=view_to_pb(view),
                leader=leader.address if leader else "",
                replica=self._advertise,
                checkpoints=[manifest_to_pb(m) for m in checkpoints],
            )
            if step is not None:
                response.step = step
                response.last_step = step
            elif progress is not None:
                response.last_step = progress[1]
            if lead is not None and lead.coordinator.rollcall is not None:
                response.rollcall_epoch = lead.coordinator.rollcall.epoch
            failure = await self._etcd(self._store.read_checkpoint_failure)
            limit = progress_limit(
                step, response.last_step if response.HasField("last_step") else None,
                view.resume_step,
            )  # fmt: skip
            response.durability.CopyFrom(durability_to_pb(durability(checkpoints, failure, limit)))
            return response
        except RollcallError as error:
            await self._abort(context, error)

    async def PublishCheckpoint(
        self, request: pb.PublishCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._check_job(request.job)
            check.check_id(request.member_id, "member_id", self._config)
            manifest = manifest_from_pb(request.checkpoint)
            check.check_digest(manifest.digest, self._config)
            check.check_id(manifest.writer, "checkpoint writer", self._config)
            check.check_counter(manifest.step, "checkpoint step")
            lead = self._leader()
            self._fence(lead, request.member_id, request.epoch)
            self._authenticate(lead, request.member_id, request.member_secret)
            view = lead.coordinator.view
            if request.epoch != view.epoch or request.member_id not in view:
                raise StaleEpoch(
                    f"member {request.member_id} is not in view {view.epoch}: "
                    "only members of the current view publish checkpoints"
                )
            if manifest.epoch > view.epoch:
                raise InvalidRequest(
                    f"checkpoint epoch {manifest.epoch} is ahead of view {view.epoch}"
                )
            limit = await self._checkpoint_limit(lead, manifest.step)
            if limit is None or manifest.step > limit:
                progress = "no committed step" if limit is None else f"step {limit - 1}"
                raise InvalidRequest(
                    f"checkpoint of step {manifest.step} is beyond the job's progress "
                    f"({progress}): a checkpoint holds a committed step"
                )
            accepted, kept = await self._etcd(
                self._store.publish_checkpoint, manifest, self._config.checkpoint_keep, limit
            )
            if accepted and self._events.checkpoint_step != manifest.step:
                log.info("checkpoint of step %d published by %s", manifest.step, manifest.writer)
                self._remember(checkpoints=tuple(kept))
                self._emit(self._events.checkpoint(self._clock(), manifest))
                await self._durability_restored(manifest)
            if accepted:
                await self._progress_covers(lead, manifest.step)
            return pb.PublishCheckpointResponse(
                accepted=accepted, checkpoints=[manifest_to_pb(m) for m in kept]
            )
        except RollcallError as error:
            await self._abort(context, error)

    async def _checkpoint_limit(self, lead: _Leadership, step: int) -> int | None:
        """The highest step the job's progress allows a checkpoint of
        (``rollcall.membership.checkpoint.progress_limit``), waiting at most
        ``checkpoint_progress_wait`` for it to reach ``step``: the writer
        reports its progress just before publishing, on another stream."""
        progress = await self._etcd(self._store.read_progress)
        deadline = self._clock() + self._config.checkpoint_progress_wait
        while True:
            limit = progress_limit(
                lead.leader.step, lead.coordinator.view.resume_step,
                progress[1] if progress else None,
            )
            if (limit is not None and step <= limit) or self._clock() >= deadline:
                return limit
            if lead.lost.is_set():
                raise NotLeader("replica lost leadership while checking a checkpoint")
            await asyncio.sleep(self._config.heartbeat_interval / 2)

    async def _progress_covers(self, lead: _Leadership, step: int) -> None:
        """The progress record is never more than one step behind the
        newest recorded checkpoint (a resuming worker checks manifests
        against it, and its replay cost counts from it): the reported step
        is written at once if the record is further behind."""
        write = lead.leader.progress_for_checkpoint(step)
        if write is None:
            return
        try:
            await self._put_progress(lead, write)
        except ControlPlaneUnavailable as exc:  # the manifest is recorded; the next write follows
            log.warning("progress of step %d not recorded with its checkpoint: %s", step, exc)

    async def _durability_restored(self, manifest: CheckpointManifest) -> None:
        """A checkpoint was recorded: a failure recorded before it is over."""
        if self._metrics is not None:
            self._metrics.durable_step.set(manifest.step)
        if self._failure is None:
            return
        failure, self._failure = self._failure, None
        log.warning(
            "checkpoints recorded again at step %d after %d failed attempts since %s",
            manifest.step, failure.failures,
            time.strftime("%H:%M:%S", time.localtime(failure.since_unix)),
        )  # fmt: skip
        try:
            await self._etcd(self._store.write_checkpoint_failure, None)
        except ControlPlaneUnavailable as exc:  # it no longer counts once a later step is recorded
            log.warning("checkpoint failure record not cleared: %s", exc)

    def _checkpoint_failed(self, lead: _Leadership, member_id: str, report: Any) -> None:
        """A member of the view could not make a checkpoint durable: record
        it (etcd, events) at most every progress_write_interval, count it
        every time."""
        self._fence(lead, member_id, report.epoch)
        check.check_counter(report.step, "checkpoint step")
        check.check_text(report.reason, "checkpoint failure reason", _MAX_REASON)
        now = self._clock()
        lead.leader.heard(member_id, now)
        view = lead.coordinator.view
        if report.epoch != view.epoch or member_id not in view:
            return  # late: the member is not in the view in force
        self._failure = next_failure(
            self._failure, self._events.checkpoint_step, report.step, report.reason, member_id,
            time.time(),
        )  # fmt: skip
        if self._metrics is not None:
            self._metrics.checkpoint_failures.inc()
        if now - self._failure_written < self._config.progress_write_interval:
            return
        self._failure_written = now
        failure = self._failure
        log.warning(
            "durability stuck at step %s: %s's checkpoint of step %d failed (%d attempts): %s",
            self._events.checkpoint_step, member_id, report.step, failure.failures,
            report.reason,
        )  # fmt: skip
        self._emit(self._events.checkpoint_failed(now, failure))
        asyncio.create_task(self._write_failure(failure))

    async def _write_failure(self, failure: CheckpointFailure) -> None:
        try:
            await self._etcd(self._store.write_checkpoint_failure, failure)
        except ControlPlaneUnavailable as exc:
            log.warning("checkpoint failure not recorded in etcd: %s", exc)

    async def ForgetCheckpoints(
        self, request: pb.ForgetCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._check_job(request.job)
            for step in request.steps:
                check.check_counter(step, "checkpoint step")
            if request.all == bool(request.steps):
                raise InvalidRequest("name the steps of the checkpoints to forget, or all")
            self._leader()
            forgotten, kept = await self._etcd(
                self._store.forget_checkpoints, None if request.all else list(request.steps)
            )
            newest = kept[0].step if kept else None
            self._remember(checkpoints=tuple(kept))
            log.warning(
                "checkpoint record: the manifests of steps %s were removed on request "
                "(%d kept)", ", ".join(str(m.step) for m in forgotten) or "none", len(kept),
            )  # fmt: skip
            self._emit(self._events.checkpoints_forgotten(self._clock(), forgotten, newest))
            return pb.ForgetCheckpointsResponse(
                forgotten=[manifest_to_pb(m) for m in forgotten],
                kept=[manifest_to_pb(m) for m in kept],
            )
        except RollcallError as error:
            await self._abort(context, error)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.View]:
        try:
            self._check_job(request.job)
            check.check_counter(request.after_epoch, "after_epoch")
        except RollcallError as error:
            await self._abort(context, error)
            return
        sent = request.after_epoch
        while True:
            view = await self._next_view(sent)
            sent = view.epoch
            yield view_to_pb(view)

    async def _next_view(self, after_epoch: int) -> View:
        async with self._view_changed:
            await self._view_changed.wait_for(lambda: self._latest_view.epoch > after_epoch)
            return self._latest_view

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        try:
            # The first message may not even decode (wire.Undecodable).
            lead, session = self._open(await anext(request_iterator))
        except StopAsyncIteration:
            return
        except RollcallError as error:
            await self._abort(context, error)
            return
        member_id = session.member_id
        reader = asyncio.create_task(self._read_session(lead, session, request_iterator))
        ended = False
        try:
            while True:
                getter = asyncio.ensure_future(session.outbox.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    item = getter.result()
                    if isinstance(item, pb.SessionEvent):
                        yield item
                        continue
                    ended = True
                    if item is not None:
                        await self._abort(context, item)
                    return
                getter.cancel()
                failure = None if reader.cancelled() else reader.exception()
                if isinstance(failure, RollcallError):
                    # A rejected message ends the stream and changes nothing
                    # else: the member may reconnect; if it stays silent the
                    # detector (still watching it) suspects it.
                    ended = True
                    if lead.sessions.get(member_id) is session:
                        del lead.sessions[member_id]
                        lead.leader.session_rejected(member_id)
                    await self._abort(context, failure)
                return
        finally:
            reader.cancel()
            if not ended and lead.sessions.get(member_id) is session:
                # The stream broke (process killed, connection cut): the
                # fastest failure signal there is.
                lead.leader.session_broken(member_id, self._clock())
                self._drain(lead)

    def _open(self, first: pb.SessionRequest) -> tuple[_Leadership, _Session]:
        if first.WhichOneof("kind") != "open":
            raise InvalidRequest("a session must start with an Open message")
        request = first.open
        self._check_job(request.job)
        check.check_id(request.member_id, "member_id", self._config)
        lead = self._leader()
        self._fence(lead, request.member_id, request.epoch)
        self._authenticate(lead, request.member_id, request.member_secret)
        now = self._clock()
        old = lead.sessions.pop(request.member_id, None)
        if old is not None:
            old.close()  # replaced by a reconnect
        session = _Session(request.member_id)
        lead.sessions[request.member_id] = session
        awaited = request.member_id in lead.coordinator.awaiting
        lead.leader.session_opened(request.member_id, now)
        if awaited:
            self._drain(lead)
        view = lead.coordinator.view
        self._send_view(session, view, self._view_events(lead, view))
        for other, (until, reason) in lead.leader.busy.items():
            if other != request.member_id and until > now:
                busy = pb.PeerBusy(member_id=other, seconds=until - now, reason=reason)
                session.send(pb.SessionEvent(busy=busy))
        rollcall = lead.coordinator.rollcall
        if rollcall is not None and request.member_id in rollcall.missing:
            self._ask(session, rollcall.epoch)
        log.info("session open: %s (epoch %d)", request.member_id, request.epoch)
        return lead, session

    async def _read_session(
        self,
        lead: _Leadership,
        session: _Session,
        requests: AsyncIterator[pb.SessionRequest],
    ) -> None:
        async for request in requests:
            if lead.sessions.get(session.member_id) is not session:
                return
            self._on_message(lead, session.member_id, request)

    def _on_message(self, lead: _Leadership, member_id: str, request: pb.SessionRequest) -> None:
        now = self._clock()
        kind = request.WhichOneof("kind")
        if kind == "heartbeat":
            self._fence(lead, member_id, request.heartbeat.epoch)
            sent_at = check.check_time(request.heartbeat.sent_at, "heartbeat sent_at")
            lead.leader.heard(member_id, now)
            session = lead.sessions.get(member_id)
            if session is not None and sent_at:
                session.send(pb.SessionEvent(ack=pb.HeartbeatAck(sent_at=sent_at)))
        elif kind == "progress":
            epoch, step = request.progress.epoch, request.progress.step
            self._fence(lead, member_id, epoch)
            check.check_counter(step, "step")
            counted = lead.leader.progress(member_id, epoch, step, now)
            if counted is not None:
                self._emit(self._events.progress(now, lead.coordinator.view, counted))
                if self._metrics is not None:
                    self._metrics.progress(counted, self._events.global_batch)
        elif kind == "answer":
            answer = request.answer
            check.check_counter(answer.epoch, "epoch")
            held = answer.step if answer.HasField("step") else None
            if held is not None:
                check.check_counter(held, "step")
            check.check_digest(answer.digest, self._config)
            try:
                lead.leader.answer(member_id, answer.epoch, held, answer.digest, now)
            except (StaleEpoch, NotAMember) as late:
                # A known member answering a roll call that already closed:
                # harmless, the view it missed will evict or include it.
                log.debug("ignored answer from %s: %s", member_id, late)
            self._drain(lead)
        elif kind == "failure":
            report = request.failure
            self._fence(lead, member_id, report.epoch)
            check.check_id(report.peer_id, "peer_id", self._config)
            check.check_text(report.reason, "reason", _MAX_REASON)
            lead.leader.heard(member_id, now)
            if report.epoch == lead.coordinator.view.epoch:
                self._on_report(lead, member_id, report, now)
        elif kind == "view_report":
            r = request.view_report
            self._fence(lead, member_id, r.epoch)
            for name in ("fetch_s", "rebuild_s", "first_step_s", "lost_work_s", "step_s",
                         "launch_s"):  # fmt: skip
                check.check_time(getattr(r, name), f"view report {name}", _MAX_REPORTED_SECONDS)
            lead.leader.heard(member_id, now)
            account = MemberReport(
                r.fetch_s, r.rebuild_s, r.first_step_s, r.lost_work_s, r.step_s, r.launch_s,
                r.global_batch,
            )  # fmt: skip
            self._emit(self._events.report(member_id, r.epoch, account, now))
        elif kind == "busy":
            busy = request.busy
            self._fence(lead, member_id, busy.epoch)
            seconds = check.check_time(busy.seconds, "busy seconds", self._config.busy_max + 1)
            check.check_text(busy.reason, "busy reason", _MAX_REASON)
            lead.leader.declare_busy(member_id, min(seconds, self._config.busy_max), busy.reason,
                                     now)  # fmt: skip
            self._drain(lead)
        elif kind == "checkpoint_failure":
            self._checkpoint_failed(lead, member_id, request.checkpoint_failure)
        elif kind == "open":
            raise InvalidRequest("Open sent twice on one session")
        else:
            raise InvalidRequest("empty session message")
