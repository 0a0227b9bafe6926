"""The replica's state and what every part of it uses: the etcd thread
pool, the events and metrics, the memory of the job's record, the views
seen, and the checks of a request (job, leader, fence, member secret).

All of it is owned by one asyncio event loop, so no locks. The replica's
parts (``actions``, ``election``, ``sessions``, ``checkpoints``, ``calls``)
are mixins over this base, each adding one concern; ``rollcall.rendezvous.
service.Replica`` puts them together."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from rollcall.membership.checkpoint import CheckpointFailure
from rollcall.membership.config import Config
from rollcall.membership.continuity import Continuity, EtcdPosition
from rollcall.membership.credentials import secret_matches
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    InvalidRequest,
    JobRecordLost,
    NoSuchJob,
    NotAMember,
    NotLeader,
    PermissionDenied,
    RollcallError,
    StaleEpoch,
)
from rollcall.membership.ratelimit import LogThrottle
from rollcall.membership.view import EMPTY_VIEW, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol import validation as check
from rollcall.protocol.wire import LEADER_METADATA, error_metadata, status_of
from rollcall.rendezvous.events import EventFile, EventLog
from rollcall.rendezvous.metrics import ServiceMetrics
from rollcall.rendezvous.replica.leadership import Leadership
from rollcall.rendezvous.store import EtcdStore, JobRecord

log = logging.getLogger("rollcall.rendezvous")
T = TypeVar("T")

#: Longest free text (failure reasons) accepted from a member.
MAX_REASON = 256
#: Seconds between two log lines about refused claims of lost etcd data.
CLAIM_LOG_INTERVAL = 60.0


class ReplicaBase:
    """The state of one rendezvous replica of one job, and the helpers
    shared by its parts."""

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
        #: Joiners' records go through threads of their own: a burst of
        #: joins must not queue the election's keep-alive and the view
        #: commits behind it (seen: the election lease lapsing every few
        #: seconds during a burst of 512 joins on a loaded machine).
        self._join_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="etcd-join")
        self._lead: Leadership | None = None
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
        #: The highest epoch recorded as lost (``_note_lost``) by this replica.
        self._lost_noted = 0
        #: Claims refused while the view is live: anyone with the token can
        #: send them, so they are logged one line per interval at most.
        self._claims_logged = LogThrottle(CLAIM_LOG_INTERVAL)
        #: The timing settings a member checks against its own: in its Join
        #: answer, and again whenever its session opens (a failover may hand
        #: it to a replica started with other settings: ``ServiceTiming``).
        self._timing = pb.ServiceTiming(**config.service_timing())
        self._timing_event = pb.SessionEvent(timing=self._timing).SerializeToString()
        #: The leader and the settings on which it differs from this replica,
        #: as last said (``Election._compare_timing``).
        self._timing_said: tuple[str, tuple[str, ...]] = ("", ())

    @property
    def is_leader(self) -> bool:
        return self._lead is not None

    async def _etcd(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _read_job(self) -> tuple[JobRecord, EtcdPosition, bool]:
        """The job's record, etcd's position, and whether the answer is
        stale: something newer was seen while it was on its way
        (``Continuity.stale``), so it says nothing about lost data."""
        ticket = self._continuity.ticket()
        record, position = await self._etcd(self._store.read_job)
        return record, position, self._continuity.stale(ticket)

    async def _etcd_for_joins(self, fn: Callable[..., T], *args: Any) -> T:
        """``_etcd`` in the joiners' own threads."""
        return await asyncio.get_running_loop().run_in_executor(self._join_pool, fn, *args)

    def _lose(self, lead: Leadership, reason: str) -> None:
        if not lead.lost.is_set():
            lead.lost_reason = reason
            lead.lost.set()

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

    def _remember(self, **changes: Any) -> None:
        """Update this replica's memory of the job's record (what it would
        write back if etcd lost it); ``None`` values change nothing."""
        known = self._remembered or JobRecord(EMPTY_VIEW, 0, None, None, ())
        updates = {k: v for k, v in changes.items() if v is not None}
        self._remembered = dataclasses.replace(known, **updates)

    def _record_of(self, lead: Leadership) -> JobRecord:
        """The job's record as the leader knows it now."""
        view = lead.coordinator.view
        known = self._remembered or JobRecord(EMPTY_VIEW, 0, None, None, ())
        step = lead.leader.step
        progress = (view.epoch, step) if step is not None else known.progress
        return dataclasses.replace(known, view=view, view_revision=lead.view_revision,
                                   progress=progress)  # fmt: skip

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

    def _check_job(self, job: str) -> None:
        check.check_id(job, "job", self._config)
        if job != self._job:
            raise NoSuchJob(f"no such job {job!r}: this service serves job {self._job!r}")

    def _leader(self) -> Leadership:
        lead = self._lead
        if lead is None:
            raise NotLeader(
                f"replica {self._advertise} is not the leader of job {self._job}",
                leader=None,
            )
        return lead

    def _ahead(self, lead: Leadership, member_id: str, epoch: int) -> RollcallError:
        """The error for a member's message whose epoch is ahead of this
        leader's view: this replica is behind (another one committed that
        epoch), the message is malformed (a member it knows cannot be
        ahead), or, from a member it has never heard of, etcd lost the view
        the member is in and no replica remembers it.

        The last is a claim nothing authenticates (the member's record is
        what etcd lost), so it is recorded in etcd (``_note_lost``) only
        while nothing contradicts it: no member of the view in force holds
        a session here. A job training at the epoch etcd holds has not lost
        a later one, and a token holder naming an unknown id must not be
        able to block the job's fresh starts (docs/protocol.md, "Lost etcd
        data")."""
        view = lead.coordinator.view
        committed = view.epoch
        if epoch <= self._continuity.epoch:
            return NotLeader(
                f"replica {self._advertise} is behind epoch {epoch} (it holds {committed}): "
                "it no longer leads"
            )
        if lead.coordinator.knows(member_id):
            return InvalidRequest(f"epoch {epoch} is ahead of the committed epoch {committed}")
        live = any(lead.leader.has_session(member) for member in view.ids)
        if live:
            left_out = self._claims_logged.due(time.monotonic())
            if left_out is not None:
                log.warning(
                    "member %s claims epoch %d, ahead of view %d, which etcd does not hold; "
                    "not recorded as a loss of etcd's data: members of view %d are live here "
                    "(%d such claims since the last line; one line per %.0f s at most)",
                    member_id, epoch, committed, committed, left_out, CLAIM_LOG_INTERVAL,
                )  # fmt: skip
        elif epoch > self._lost_noted:
            self._lost_noted = epoch
            asyncio.ensure_future(self._note_lost(member_id, epoch))
        return JobRecordLost(
            f"member {member_id} is at epoch {epoch}, but etcd holds job {self._job} at epoch "
            f"{committed} and this replica never saw a later one: etcd lost the job's data "
            "(wiped, replaced or restored from an old backup) and no replica remembered it. "
            "This worker's state is intact but cannot rejoin under its old id: restart the "
            "job's workers"
        )

    async def _note_lost(self, member_id: str, epoch: int) -> None:
        """Record in etcd that the job trained up to epoch ``epoch`` before
        etcd lost its data, so that workers started again do not start it at
        step 0 unawares (``Status.lost_epoch``)."""
        try:
            await self._etcd(self._store.record_lost, epoch)
        except ControlPlaneUnavailable as exc:
            self._lost_noted = 0  # the next refused member tries again
            log.warning("the loss of job %s's data is not recorded: %s", self._job, exc)
            return
        log.error(
            "etcd lost job %s's data and no replica remembers it: member %s is at epoch %d, "
            "etcd holds none; recorded, so that workers started again refuse to start the "
            "job at step 0 without checkpoint files or --start-over",
            self._job, member_id, epoch,
        )  # fmt: skip

    def _fence(self, lead: Leadership, member_id: str, epoch: int) -> None:
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

    def _acting_for(self, member_id: str, epoch: int, secret: str) -> Leadership:
        """The leadership, for a request acting for ``member_id``: this
        replica leads, the member may act at ``epoch`` and the request
        carries its secret (``_fence``, ``_authenticate``)."""
        lead = self._leader()
        self._fence(lead, member_id, epoch)
        self._authenticate(lead, member_id, secret)
        return lead

    def _authenticate(self, lead: Leadership, member_id: str, presented: str) -> None:
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
