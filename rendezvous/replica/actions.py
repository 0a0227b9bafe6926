"""Carrying out the leader's decisions (``rollcall.membership.leader.
Leader``'s actions): the driver loop that lets time pass for it, roll-call
requests, view commits to etcd (and putting the view back when someone else
wrote it), announcing views on the sessions, evictions, busy periods and
progress writes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from rollcall.membership.backoff import Backoff
from rollcall.membership.cause import CauseKind
from rollcall.membership.coordinator import CommitView, Refusal, RefusedClaim, RequestAnswers
from rollcall.membership.credentials import epoch_secret
from rollcall.membership.delta import delta_between
from rollcall.membership.errors import ControlPlaneUnavailable, Evicted, RollcallError
from rollcall.membership.leader import Evict, Evidence, PeerBusy, WriteProgress
from rollcall.membership.view import View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol.wire import delta_to_pb, view_to_pb
from rollcall.rendezvous.replica.base import ReplicaBase
from rollcall.rendezvous.replica.leadership import (
    Announcement,
    Carrier,
    Leadership,
    MemberSession,
)
from rollcall.rendezvous.store import MemberRecord

log = logging.getLogger("rollcall.rendezvous")

#: The most causes a roll-call request names (members leaving or failing).
ROLLCALL_CAUSES_TOLD = 64


class LeaderActions(ReplicaBase):
    """The leader's actions, carried out on etcd and the sessions."""

    async def _drive(self, lead: Leadership) -> None:
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
                # Not wait_for: that makes a task per wake-up, and every
                # roll-call answer wakes this loop.
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
                leader.woke(self._clock(), None)
            except TimeoutError:
                late = leader.woke(self._clock(), now + timeout)
                if late is not None:
                    log.warning("replica lagging by %.0f ms: suspicions deferred", late * 1000)

    def _drain(self, lead: Leadership) -> None:
        """Carry out the leader's actions."""
        for action in lead.leader.take_actions():
            if isinstance(action, RequestAnswers):
                self._events.rollcall(self._clock())
                shared: dict[str, tuple[Carrier, list[int]]] = {}
                for member_id in action.member_ids:
                    session = lead.sessions.get(member_id)
                    if session is None or session.asked_epoch >= action.epoch:
                        continue
                    carrier = session.carrier
                    if carrier is None:
                        self._ask(session, action.epoch)
                    else:  # one request per shared stream, for all its members called
                        session.asked_epoch = action.epoch
                        shared.setdefault(carrier.key, (carrier, []))[1].append(session.slot)
                if shared:
                    request = self._request_bytes(action.epoch)
                    for carrier, slots in shared.values():
                        carrier.send(request, slots)
            elif isinstance(action, CommitView):
                for claim in action.refused:
                    self._log_refused(action.view, claim)
                if action.put_off:
                    self._log_put_off(action)
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

    @staticmethod
    def _log_put_off(action: CommitView) -> None:
        """Candidates kept out of a view whose holders answered before
        their loop's code after commit() ran (``decide_view``)."""
        view, previous = action.view, action.previous
        joiners = [i for i in action.put_off if i not in previous]
        members = [i for i in action.put_off if i in previous]
        kept_out = []
        if joiners:
            kept_out.append(f"joiners {', '.join(joiners)} are put off to the next roll call")
        if members:
            kept_out.append(
                f"{', '.join(members)}, which would have fetched it, lose their place (a "
                "worker so evicted starts again and joins anew)"
            )
        log.warning(
            "roll call %d: %s answered step %s before their training loop's code after "
            "commit() ran (a sharded step whose all-gather failed completes in the next "
            "view): nobody may take their registered state yet; %s",
            view.epoch, ", ".join(action.unsettled), view.resume_step, "; ".join(kept_out),
        )  # fmt: skip

    def _ask(self, session: MemberSession, epoch: int) -> None:
        if session.asked_epoch >= epoch:
            return
        session.asked_epoch = epoch
        session.send(self._request_bytes(epoch))

    def _request_bytes(self, epoch: int) -> bytes:
        """Roll call ``epoch``'s request, encoded once."""
        lead = self._lead
        causes = lead.coordinator.rollcall.causes if lead and lead.coordinator.rollcall else ()
        if lead is not None and lead.asking is not None and lead.asking[:2] == (epoch, causes):
            return lead.asking[2]
        # Members learn who joins from the view itself: the request names
        # the members leaving or failing only, the first few (the events
        # file has them all). A burst of 2,000 joins made every request
        # 60 kB, parsed by every member.
        told = [str(c) for c in causes if c.kind is not CauseKind.JOIN][:ROLLCALL_CAUSES_TOLD]
        rollcall = lead.coordinator.rollcall if lead is not None else None
        at_step_end = rollcall is not None and rollcall.epoch == epoch and rollcall.at_step_end
        request = pb.RollCallRequest(epoch=epoch, causes=told, at_step_end=at_step_end)
        encoded = pb.SessionEvent(roll_call=request).SerializeToString()
        if lead is not None:
            lead.asking = (epoch, causes, encoded)
        return encoded

    async def _counted_commit(self, lead: Leadership, action: CommitView) -> None:
        lead.committing += 1
        try:
            await self._commit(lead, action)
        finally:
            lead.committing -= 1

    async def _commit(self, lead: Leadership, action: CommitView) -> None:
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
                            revision == lead.view_revision or current.epoch < action.previous.epoch
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
        self._announce(lead, action.view, action.previous)
        self._drain(lead)

    async def _written_behind_our_back(
        self, lead: Leadership, stored: View | None, malformed: str
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

    async def _guard_view(self, lead: Leadership) -> None:
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

    def _view_events(self, lead: Leadership, view: View, base: View | None = None) -> Announcement:
        """The events announcing ``view`` (as a change of ``base`` where it
        can be one), encoded once however many sessions receive them."""
        known = lead.announcing
        if known is not None and known.view == view and (base is None or known.delta is not None):
            return known
        secret = epoch_secret(lead.epoch_key, self._job, view)
        delta = delta_between(base, view) if base is not None else None
        message = (
            known.message if known is not None and known.view == view else view_to_pb(view)
        )
        announcement = Announcement(
            view=view,
            message=message,
            secret=pb.SessionEvent(
                epoch_secret=pb.EpochSecret(epoch=view.epoch, secret=secret)
            ).SerializeToString(),
            whole=pb.SessionEvent(view=message).SerializeToString(),
            delta=None,
            delta_with_secret=None,
            base_epoch=delta.base_epoch if delta is not None else 0,
        )
        if delta is not None:
            change = delta_to_pb(delta)
            plain = pb.SessionEvent(view_delta=change).SerializeToString()
            change.epoch_secret = secret
            announcement = dataclasses.replace(
                announcement,
                delta=plain,
                delta_with_secret=pb.SessionEvent(view_delta=change).SerializeToString(),
            )
        lead.announcing = announcement
        return announcement

    @classmethod
    def _send_view(
        cls, session: MemberSession, announcement: Announcement, opening: bool = False
    ) -> None:
        """Send a view on ``session`` (``_view_bytes``)."""
        for event in cls._view_bytes(session, announcement, opening):
            session.send(event)

    @staticmethod
    def _view_bytes(
        session: MemberSession, announcement: Announcement, opening: bool = False
    ) -> tuple[bytes, ...]:
        """The events that bring ``session`` the announced view, with its
        epoch secret if the session's member is in it (never to anyone
        else): as a change of the view the session carried last when its
        member applies changes (the secret in it), else whole (preceded by
        the secret). A shared session's member ``opening`` that holds the
        view already (its holder had it) is sent the secret alone."""
        view = announcement.view
        member = session.member_id in view
        events: tuple[bytes, ...]
        if opening and session.announced == view.epoch:
            events = (announcement.secret,) if member else ()
        elif (
            announcement.delta is not None
            and announcement.delta_with_secret is not None
            and session.deltas
            and session.announced == announcement.base_epoch
        ):
            events = (announcement.delta_with_secret if member else announcement.delta,)
        elif member:
            events = (announcement.secret, announcement.whole)
        else:
            events = (announcement.whole,)
        session.announced = view.epoch
        return events

    def _announce(self, lead: Leadership, view: View, previous: View) -> None:
        """Send a committed view on every session (members it removes are
        evicted after it: ``Evict`` actions), as a change of ``previous``
        to those that carried it; on a shared stream, each event once for
        all the members it is for."""
        announcement = self._view_events(lead, view, previous)
        shared: dict[tuple[str, tuple[bytes, ...]], tuple[Carrier, list[int]]] = {}
        for session in list(lead.sessions.values()):
            carrier = session.carrier
            if carrier is None:
                self._send_view(session, announcement)
                continue
            events = self._view_bytes(session, announcement)
            shared.setdefault((carrier.key, events), (carrier, []))[1].append(session.slot)
        for (_, events), (carrier, slots) in shared.items():
            for event in events:
                carrier.send(event, slots)
        self._tell_pace(lead)

    def _tell_pace(self, lead: Leadership, session: MemberSession | None = None) -> None:
        """Tell the members the heartbeat interval for the view's size
        (``Leader.pace``): every session when it changed, or ``session``
        (one that opened) when it differs from the configured one."""
        interval = lead.leader.pace
        if session is not None:
            if interval != self._config.heartbeat_interval:
                session.send(self._pace_event(lead, interval))
            return
        if lead.pace is not None and lead.pace[0] == interval:
            return
        if lead.pace is None and interval == self._config.heartbeat_interval:
            return
        event = self._pace_event(lead, interval)
        log.info("heartbeat interval %.0f ms for %d members", interval * 1000,
                 lead.coordinator.view.size)  # fmt: skip
        for other in list(lead.sessions.values()):
            if other.carrier is None:
                other.send(event)
        for carrier in list(lead.carriers.values()):
            carrier.send(event)  # the stream's own heartbeats

    @staticmethod
    def _pace_event(lead: Leadership, interval: float) -> bytes:
        if lead.pace is None or lead.pace[0] != interval:
            pace = pb.Pace(heartbeat_interval_ms=round(interval * 1000))
            lead.pace = (interval, pb.SessionEvent(pace=pace).SerializeToString())
        return lead.pace[1]

    def _evict(self, lead: Leadership, action: Evict) -> None:
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
            asyncio.create_task(self._remove_record(lead, record))

    async def _remove_record(self, lead: Leadership, record: MemberRecord) -> None:
        try:
            await self._etcd(self._store.remove_member, record.member.id, record.lease_id)
        except ControlPlaneUnavailable:
            # Not kept alive any more, the record expires with its lease;
            # the secret hash has none: deleted once etcd answers.
            lead.unremoved.add(record.member.id)

    async def _forget_secrets(self, lead: Leadership, member_ids: set[str]) -> None:
        """Delete the secret hashes of members this leader removed or does
        not know (a member id is never given out twice); those etcd does
        not delete now are tried again in the next keep-alive round."""
        lead.unremoved |= member_ids
        if not lead.unremoved:
            return
        doomed = set(lead.unremoved)
        await self._etcd(self._store.forget_secrets, sorted(doomed))
        lead.unremoved -= doomed
        for member_id in doomed:
            lead.secret_hashes.pop(member_id, None)

    def _tell_busy(self, lead: Leadership, action: PeerBusy) -> None:
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
        ).SerializeToString()
        shared: dict[str, tuple[Carrier, list[int]]] = {}
        for other, session in lead.sessions.items():
            if other == member_id:
                continue
            carrier = session.carrier
            if carrier is None:
                session.send(event)
            else:
                shared.setdefault(carrier.key, (carrier, []))[1].append(session.slot)
        for carrier, slots in shared.values():
            carrier.send(event, slots)

    async def _put_progress(self, lead: Leadership, write: WriteProgress) -> None:
        if await self._etcd(self._store.write_progress_as, lead.info, write.epoch, write.step):
            lead.leader.progress_written(write.epoch, write.step)

    async def _flush_progress(self, lead: Leadership, write: WriteProgress) -> None:
        """The last step of a view that is being replaced, whatever the rate."""
        try:
            await self._put_progress(lead, write)
        except ControlPlaneUnavailable as exc:
            log.warning("progress of epoch %d not recorded: %s", write.epoch, exc)

    async def _record_progress(self, lead: Leadership) -> None:
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
