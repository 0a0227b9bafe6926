"""Members' session streams on the leader: opening one (fenced and
authenticated), the messages a member sends on it (heartbeats, progress,
roll-call answers, failure reports, view reports, busy periods, checkpoint
failures, requests for the whole view), and what a broken stream means."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from rollcall.membership.coordinator import ReportOutcome
from rollcall.membership.errors import InvalidRequest, NotAMember, RollcallError, StaleEpoch
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol import validation as check
from rollcall.rendezvous.events import MemberReport
from rollcall.rendezvous.replica.base import MAX_REASON
from rollcall.rendezvous.replica.checkpoints import CheckpointCalls
from rollcall.rendezvous.replica.leadership import READER_ENDED, Leadership, MemberSession

log = logging.getLogger("rollcall.rendezvous")

#: Largest duration a member may report (anything above is malformed).
_MAX_REPORTED_SECONDS = 1e6


class Sessions(CheckpointCalls):
    """The ``Session`` RPC."""

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent | bytes]:
        """The member's session: events, or events encoded once for many
        sessions (``bytes``, sent as they are: ``rollcall.protocol.wire``)."""
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
        # The reader's end is one more item in the outbox: each event sent
        # costs one wait on one queue, not a task and a wait on two (every
        # heartbeat's acknowledgement is such an event).
        reader.add_done_callback(lambda _: session.outbox.put_nowait(READER_ENDED))
        ended = False
        try:
            while True:
                item = await session.outbox.get()
                if isinstance(item, (pb.SessionEvent, bytes)):
                    yield item
                    continue
                if item is not READER_ENDED:
                    ended = True
                    if isinstance(item, RollcallError):
                        await self._abort(context, item)
                    return
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

    def _open(self, first: pb.SessionRequest) -> tuple[Leadership, MemberSession]:
        if first.WhichOneof("kind") != "open":
            raise InvalidRequest("a session must start with an Open message")
        request = first.open
        self._check_job(request.job)
        check.check_id(request.member_id, "member_id", self._config)
        lead = self._acting_for(request.member_id, request.epoch, request.member_secret)
        now = self._clock()
        old = lead.sessions.pop(request.member_id, None)
        if old is not None:
            old.close()  # replaced by a reconnect
        session = MemberSession(request.member_id, deltas=request.view_deltas)
        lead.sessions[request.member_id] = session
        awaited = lead.coordinator.is_awaited(request.member_id)
        lead.leader.session_opened(request.member_id, now)
        if awaited:
            self._drain(lead)
        view = lead.coordinator.view
        self._send_view(session, self._view_events(lead, view))
        self._tell_pace(lead, session)
        for other, (until, reason) in lead.leader.busy.items():
            if other != request.member_id and until > now:
                busy = pb.PeerBusy(member_id=other, seconds=until - now, reason=reason)
                session.send(pb.SessionEvent(busy=busy))
        rollcall = lead.coordinator.rollcall
        if (
            rollcall is not None
            and rollcall.is_candidate(request.member_id)
            and request.member_id not in rollcall.answers
        ):
            self._ask(session, rollcall.epoch)
        log.info("session open: %s (epoch %d)", request.member_id, request.epoch)
        return lead, session

    async def _read_session(
        self,
        lead: Leadership,
        session: MemberSession,
        requests: AsyncIterator[pb.SessionRequest],
    ) -> None:
        async for request in requests:
            if lead.sessions.get(session.member_id) is not session:
                return
            self._on_message(lead, session.member_id, request)

    def _on_message(self, lead: Leadership, member_id: str, request: pb.SessionRequest) -> None:
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
            shards = answer.shard_epoch if answer.HasField("shard_epoch") else None
            if shards is not None:
                check.check_counter(shards, "shard_epoch")
            try:
                lead.leader.answer(member_id, answer.epoch, held, answer.digest, now, shards)
            except (StaleEpoch, NotAMember) as late:
                # A known member answering a roll call that already closed:
                # harmless, the view it missed will evict or include it.
                log.debug("ignored answer from %s: %s", member_id, late)
            self._drain(lead)
        elif kind == "failure":
            report = request.failure
            self._fence(lead, member_id, report.epoch)
            check.check_id(report.peer_id, "peer_id", self._config)
            check.check_text(report.reason, "reason", MAX_REASON)
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
            check.check_text(busy.reason, "busy reason", MAX_REASON)
            lead.leader.declare_busy(member_id, min(seconds, self._config.busy_max), busy.reason,
                                     now)  # fmt: skip
            self._drain(lead)
        elif kind == "checkpoint_failure":
            self._checkpoint_failed(lead, member_id, request.checkpoint_failure)
        elif kind == "view_request":
            # A view sent as a change did not apply to the member's view:
            # the whole view in force, whatever the member holds.
            check.check_counter(request.view_request.epoch, "epoch")
            session = lead.sessions.get(member_id)
            if session is not None:
                session.announced = 0
                self._send_view(session, self._view_events(lead, lead.coordinator.view))
        elif kind == "open":
            raise InvalidRequest("Open sent twice on one session")
        else:
            raise InvalidRequest("empty session message")

    def _on_report(
        self, lead: Leadership, member_id: str, report: pb.FailureReport, now: float
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
