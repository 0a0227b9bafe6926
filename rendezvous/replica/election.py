"""Leading a job: the etcd election, taking the job's record over (or
writing it back when etcd lost it), the keep-alive round that holds the
election and the members' leases through etcd outages, the takeover grace
for members of an inherited view, and a standby's poll of the record."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

from rollcall.membership.backoff import Backoff
from rollcall.membership.checkpoint import stuck_since
from rollcall.membership.continuity import EtcdPosition
from rollcall.membership.errors import ControlPlaneUnavailable, MalformedRecord, NotLeader
from rollcall.membership.leader import Leader
from rollcall.membership.shards import Sharding
from rollcall.membership.view import Member
from rollcall.rendezvous.probe import process_answers
from rollcall.rendezvous.replica.actions import LeaderActions
from rollcall.rendezvous.replica.leadership import Leadership
from rollcall.rendezvous.store import JobRecord, LeaderInfo

log = logging.getLogger("rollcall.rendezvous")


#: Reads of the job's record a new leader makes before giving up when
#: each answer is overtaken by a newer observation (``Continuity.stale``).
TAKEOVER_READS = 5


class Election(LeaderActions):
    """Winning, holding and giving back the job's leadership."""

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

    def _leader_seen(self, leader: LeaderInfo | None) -> None:
        """(The leader key changed.) Wake the campaign, and compare the
        leader's timing settings with this replica's."""
        self._leader_changed.set()
        self._compare_timing(leader)

    async def _compare_with_leader(self) -> None:
        """(At start.) Compare the leader in office (``_compare_timing``);
        the watch of the leader key compares the next ones."""
        try:
            leader = await self._etcd(self._store.read_leader)
        except ControlPlaneUnavailable:
            return
        self._compare_timing(leader)

    def _compare_timing(self, leader: LeaderInfo | None) -> None:
        """Say, once per leader, when it runs with other timing settings
        than this replica: its members checked its settings against their
        own, and a failover to this replica makes those whose settings do
        not fit these leave (``ServiceTiming``), which the operator should
        learn now rather than at the failover."""
        if leader is None or leader.replica_id == self.replica_id or not leader.timing:
            return
        ours = self._config.service_timing()
        differ = tuple(
            name for name, value in leader.timing
            if name in ours and not math.isclose(value, ours[name], rel_tol=1e-9)
        )  # fmt: skip
        said = (leader.replica_id, differ)
        if said == self._timing_said:
            return
        self._timing_said = said
        if not differ:
            return
        theirs = dict(leader.timing)
        log.error(
            "replica %s of job %s runs with other timing settings than its leader %s (%s): "
            "at a failover to this replica, workers whose own settings do not fit these leave "
            "the job (UnsafeTiming, exit 5). Give every replica of a job the same --set values",
            self._advertise, self._job, leader.address,
            "; ".join(f"{name.removesuffix('_s')} {ours[name]:g} s here, {theirs[name]:g} s "
                      "at the leader" for name in differ),
        )  # fmt: skip

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
        stored = await self._etcd(self._store.list_secret_hashes)
        hashes = {i: h for i, h in stored.items() if i in view or i in records}
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
        lead = Leadership(
            info=info,
            leader=Leader(self._config, view, now, joiners),
            view_revision=revision,
            records=records,
            epoch_key=epoch_key,
            secret_hashes=hashes,
            # Members it does not know were removed while etcd did not
            # answer (or never opened a session): their hashes go.
            unremoved=set(stored) - set(hashes),
        )
        if record.fingerprint is not None and lead.coordinator.sharding is None:
            lead.coordinator.sharding = Sharding.from_fingerprint(record.fingerprint)
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

    async def _keep_alive(self, lead: Leadership) -> None:
        """Every third of the shortest TTL: check that etcd still holds the
        job's history, hold the election, and every third of the members'
        TTL keep their leases alive.
        While etcd does not answer, nothing is decided: sessions stay open,
        heartbeats are acknowledged and training goes on."""
        period = min(self._config.election_ttl, self._config.member_lease_ttl) / 3
        # The members' leases are refreshed every third of their own TTL,
        # not every round: at thousands of members that is thousands of
        # keep-alives each round, and their TTL is five times the election's.
        # Right after etcd answers again, they are looked at at once.
        members_due = -float("inf")
        while True:
            try:
                if not await self._hold_leadership(lead):
                    return
                now = self._clock()
                if now >= members_due or lead.unreachable_since is not None:
                    await self._keep_members(lead)
                    members_due = now + self._config.member_lease_ttl / 3
                await self._forget_secrets(lead, set())
                self._answered_again(lead)
                self._emit(self._events.tick(self._clock()))
            except ControlPlaneUnavailable as exc:
                self._unreachable(lead, exc)
            await asyncio.sleep(period)

    async def _hold_leadership(self, lead: Leadership) -> bool:
        """One keep-alive round's checks of etcd; False once this replica
        no longer leads. Its election lease having expired is no reason to
        step down (etcd could not keep it alive: a stall, or this replica
        could not reach it for longer than its TTL): if nobody took over,
        it takes the election again and keeps every session."""
        before = lead.view_revision
        record, position, stale = await self._read_job()
        # A commit of ours that ran while etcd was read makes the record
        # older than the epoch this replica has seen since, which is no loss
        # of data (seen under load: a needless restore and step down): the
        # record is not checked nor remembered this round.
        raced = stale or bool(lead.committing) or lead.view_revision != before
        if not raced and record.view_revision != lead.view_revision:
            # Not the view this leader committed (only the leader commits):
            # one written behind its back (``_guard_view`` puts its own back)
            # says nothing about how far the job got, so a higher epoch in
            # it must not count as history that a restore would then "lose".
            mine = lead.coordinator.view.epoch
            position = dataclasses.replace(position, epoch=min(position.epoch, mine))
        lost = None if raced else self._continuity.lost(position)
        if lost is not None:
            return await self._restore_in_place(lead, record, position, lost)
        if not raced:
            self._continuity.advance(position)
            self._remember(fingerprint=record.fingerprint, checkpoints=record.checkpoints,
                           progress=record.progress)  # fmt: skip
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

    async def _keep_members(self, lead: Leadership) -> None:
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

    async def _register_again(self, lead: Leadership, member_ids: list[str]) -> None:
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
                asyncio.create_task(self._remove_record(lead, record))
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
    def _member_of(lead: Leadership, member_id: str) -> Member | None:
        record = lead.records.get(member_id)
        if record is not None:
            return record.member
        coordinator = lead.coordinator
        candidates = coordinator.rollcall.candidates if coordinator.rollcall else ()
        for member in (*coordinator.view.members, *coordinator.pending_joiners, *candidates):
            if member.id == member_id:
                return member
        return None

    def _unreachable(self, lead: Leadership, exc: ControlPlaneUnavailable) -> None:
        if lead.unreachable_since is None:
            lead.unreachable_since = self._clock()
            log.warning(
                "etcd does not answer (%s): sessions stay open and training goes on; view "
                "changes and the progress record wait until it answers again", exc,
            )  # fmt: skip
        else:
            log.debug("etcd still does not answer: %s", exc)

    def _answered_again(self, lead: Leadership) -> None:
        if lead.unreachable_since is not None:
            log.warning(
                "etcd answers again after %.1f s: nobody was evicted for it",
                self._clock() - lead.unreachable_since,
            )
            lead.unreachable_since = None

    async def _account_for_absent(self, lead: Leadership) -> None:
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
        for _ in range(TAKEOVER_READS):
            record, position, stale = await self._read_job()
            if not stale:
                break
        else:
            raise ControlPlaneUnavailable(
                f"etcd's record of the job changed under each of {TAKEOVER_READS} reads "
                "while taking over"
            )
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
        self, lead: Leadership, found: JobRecord, position: EtcdPosition, lost: str
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

    async def _poll_view_forever(self) -> None:
        """Backstop for the etcd watch (which is lost while etcd is down),
        and the standby's memory of the job's record (``_remember``)."""
        while True:
            try:
                lead = self._lead
                if lead is None:
                    record, position, stale = await self._read_job()
                    if not stale and self._lead is None:
                        self._follow_record(record, position)
                else:
                    await self._guard_view(lead)
            except ControlPlaneUnavailable:
                pass
            await asyncio.sleep(self._config.view_poll_interval)
