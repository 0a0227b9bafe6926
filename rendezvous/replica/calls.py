"""The members' and clients' unary calls: ``Join`` (with the job
fingerprint's admission), ``Leave``, ``Status`` and ``Watch``."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from rollcall.membership.checkpoint import durability, progress_limit
from rollcall.membership.credentials import SECRET_BYTES, secret_hash
from rollcall.membership.errors import (
    ConfigurationMismatch,
    ControlPlaneUnavailable,
    NotLeader,
    RollcallError,
)
from rollcall.membership.fingerprint import (
    JobActivity,
    JobFingerprint,
    Verdict,
    admit,
    describe_mismatch,
)
from rollcall.membership.shards import Sharding
from rollcall.membership.view import Member, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol import validation as check
from rollcall.protocol.wire import durability_to_pb, manifest_to_pb, view_to_pb
from rollcall.rendezvous.replica.actions import LeaderActions
from rollcall.rendezvous.replica.leadership import Leadership
from rollcall.rendezvous.store import MEMBERS_PER_TXN, MemberRecord

log = logging.getLogger("rollcall.rendezvous")

#: Compare-and-swap rounds on the job's fingerprint before a join gives up.
_FINGERPRINT_ATTEMPTS = 5


class MemberCalls(LeaderActions):
    """``Join``, ``Leave``, ``Status`` and ``Watch``."""

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
                await self._admitted(lead, fingerprint, request.address)
                # Admitted: from here this joiner counts as one when another
                # fingerprint is judged (the job is not empty), so it need
                # not hold the others up while its record is written.
                try:
                    await self._enrol(lead, member, secret)
                finally:
                    lead.admitted_joining -= 1
            log.info("join %s at %s", member.id, request.address)
            response = pb.JoinResponse(
                member_id=member.id,
                heartbeat_interval_ms=round(lead.leader.pace * 1000),
                earliest_suspicion_s=self._timing.earliest_suspicion_s,
                rollcall_deadline_s=self._timing.rollcall_deadline_s,
                rollcall_step_end_wait_s=self._timing.rollcall_step_end_wait_s,
                election_ttl_s=self._timing.election_ttl_s,
                member_secret=secret,
            )
            if not request.view_on_session:
                # Encoded once per view, not once per joiner (a burst of
                # 2,048 joins answered views of up to 2,000 members).
                response.view.CopyFrom(self._view_events(lead, lead.coordinator.view).message)
            return response
        except RollcallError as error:
            await self._abort(context, error)

    async def _enrol(self, lead: Leadership, member: Member, secret: str) -> None:
        """Record a joiner (with the hash of its secret) in etcd and hand it
        to the coordinator."""
        record = await self._record_member(lead, member, secret_hash(secret))
        if lead.lost.is_set():
            raise NotLeader("replica lost leadership during the join")
        now = self._clock()
        lead.records[member.id] = record
        lead.leader.joined(record.member, now)
        self._events.cause(now, "join")
        self._drain(lead)

    async def _admitted(self, lead: Leadership, fingerprint: JobFingerprint, address: str) -> None:
        """Admit a fingerprinted joiner (``_admit``), or raise; counted in
        ``admitted_joining`` once admitted. A joiner with the fingerprint
        this leader last confirmed in etcd is admitted at once; any other
        is judged one at a time, and while one is, nobody is admitted at
        once (it may replace the job's fingerprint)."""
        if fingerprint != lead.admitted:
            async with self._admitting:
                if fingerprint != lead.admitted:
                    lead.admitted = None
                    await self._admit(lead, fingerprint, address)
                lead.admitted_joining += 1
        else:
            lead.admitted_joining += 1

    async def _record_member(self, lead: Leadership, member: Member, hashed: str) -> MemberRecord:
        """The joiner's etcd record, written with those of the other joiners
        waiting meanwhile (``_record_members``)."""
        written: asyncio.Future[MemberRecord] = asyncio.get_running_loop().create_future()
        lead.enrolling.append((member, hashed, written))
        if lead.enroller is None or lead.enroller.done():
            lead.enroller = asyncio.create_task(self._record_members(lead), name="enrol")
        return await written

    async def _record_members(self, lead: Leadership) -> None:
        """Write the waiting joiners' records, a batch at a time: their
        leases granted side by side, then one transaction for the batch
        (``EtcdStore.add_members``). A lone joiner is written at once; a
        burst of joiners waits for the batch ahead of it and goes in the
        next one. Should a batch not be written (an id taken: never, ids
        are random; etcd unavailable), its joiners are told so, each."""
        while lead.enrolling:
            batch = lead.enrolling[:MEMBERS_PER_TXN]
            del lead.enrolling[:MEMBERS_PER_TXN]
            entries = [(member, hashed) for member, hashed, _ in batch]
            try:
                leases = await asyncio.gather(
                    *(self._etcd_for_joins(self._store.grant_member_lease) for _ in batch)
                )
                records = await self._etcd_for_joins(self._store.add_members, entries, leases)
            except Exception as error:  # each joiner's call raises it
                for _, _, written in batch:
                    if not written.done():
                        written.set_exception(error)
                continue
            for record, (_, _, written) in zip(records, batch, strict=True):
                if not written.done():
                    written.set_result(record)

    async def _admit(self, lead: Leadership, fingerprint: JobFingerprint, address: str) -> None:
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
                members=lead.coordinator.staying,
                joiners=sum(1 for member_id in lead.records if member_id not in view)
                + lead.admitted_joining,
                progress=stored.progress or lead.leader.trained,
                checkpoints=stored.checkpoints,
            )
            admission = admit(fingerprint, stored.fingerprint, activity)
            if admission.verdict is Verdict.MATCHES:
                self._remember(fingerprint=fingerprint.as_dict())
                self._learn_sharding(lead, fingerprint.as_dict())
                lead.admitted = fingerprint
                return
            if admission.verdict is Verdict.REFUSE:
                refusal = describe_mismatch(self._job, admission.differences)
                log.info("join from %s refused: %s", address, refusal)
                raise ConfigurationMismatch(refusal)
            if not await self._etcd(self._store.record_fingerprint, fingerprint, stored.revision):
                continue  # another writer got in between: decide again
            self._remember(fingerprint=fingerprint.as_dict())
            self._learn_sharding(lead, fingerprint.as_dict())
            lead.admitted = fingerprint
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

    @staticmethod
    def _learn_sharding(lead: Leadership, fields: Mapping[str, str]) -> None:
        """The job's fingerprint says whether (and how) its optimizer state
        is sharded (a fingerprint that changes it is admitted only while the
        job is empty and has never trained)."""
        lead.coordinator.sharding = Sharding.from_fingerprint(fields)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check_job(request.job)
            check.check_id(request.member_id, "member_id", self._config)
            lead = self._acting_for(request.member_id, request.epoch, request.member_secret)
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
            lost = await self._etcd(self._store.read_lost)
            response.lost_epoch = lost or 0
            failure = await self._etcd(self._store.read_checkpoint_failure)
            limit = progress_limit(
                step, response.last_step if response.HasField("last_step") else None,
                view.resume_step,
            )  # fmt: skip
            response.durability.CopyFrom(durability_to_pb(durability(checkpoints, failure, limit)))
            return response
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
