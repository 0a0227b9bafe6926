"""Members' sessions on the leader: opening one (fenced and
authenticated), on a stream of its own or on a shared one
(docs/protocol.md, "Shared sessions"), the messages a member sends on it
(heartbeats, progress, roll-call answers, failure reports, view reports,
busy periods, checkpoint failures, requests for the whole view), and what a
broken stream means."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from rollcall.membership.coordinator import ReportOutcome
from rollcall.membership.errors import (
    InvalidRequest,
    NotAMember,
    NotLeader,
    RollcallError,
    StaleEpoch,
)
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol import validation as check
from rollcall.protocol.wire import end_to_pb
from rollcall.rendezvous.events import MemberReport
from rollcall.rendezvous.replica.base import MAX_REASON
from rollcall.rendezvous.replica.checkpoints import CheckpointCalls
from rollcall.rendezvous.replica.leadership import (
    READER_ENDED,
    Carrier,
    Leadership,
    MemberSession,
)

log = logging.getLogger("rollcall.rendezvous")

#: Largest duration a member may report (anything above is malformed).
_MAX_REPORTED_SECONDS = 1e6

#: Names of the shared streams in the detector ("@1", "@2", ...): no
#: member id starts with "@" (``validation.ID_PATTERN``).
_CARRIER_NUMBERS = itertools.count(1)


class Sessions(CheckpointCalls):
    """The ``Session`` RPC."""

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent | bytes]:
        """The member's session: events, or events encoded once for many
        sessions (``bytes``, sent as they are: ``rollcall.protocol.wire``)."""
        try:
            # The first message may not even decode (wire.Undecodable).
            first = await anext(request_iterator)
            if first.WhichOneof("kind") == "open" and first.open.shared:
                lead = self._leader()
                self._check_job(first.open.job)
            else:
                lead, session = self._open(first)
        except StopAsyncIteration:
            return
        except RollcallError as error:
            await self._abort(context, error)
            return
        if first.open.shared:
            async for encoded in self._shared_session(lead, first, request_iterator, context):
                yield encoded
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
                        lead.leader.session_rejected(member_id, self._clock())
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
        """A member's own stream, opened by its first message."""
        if first.WhichOneof("kind") != "open":
            raise InvalidRequest("a session must start with an Open message")
        lead, request = self._opening(first.open)
        session = MemberSession(request.member_id, deltas=request.view_deltas)
        self._seat(lead, session, request.epoch)
        return lead, session

    def _opening(self, request: pb.Open) -> tuple[Leadership, pb.Open]:
        """The checks of an Open (job, id, fence, member secret)."""
        self._check_job(request.job)
        check.check_id(request.member_id, "member_id", self._config)
        lead = self._acting_for(request.member_id, request.epoch, request.member_secret)
        return lead, request

    def _seat(self, lead: Leadership, session: MemberSession, epoch: int) -> None:
        """Put an opened session on the books, replacing the member's
        previous one, and send it what a member needs on opening: this
        replica's timing settings (first: a member whose own do not fit
        them leaves before it acts on anything else), the view in force,
        the heartbeat pace, the peers busy now, and the roll call if one
        waits for its answer."""
        member_id = session.member_id
        now = self._clock()
        old = lead.sessions.pop(member_id, None)
        if old is not None:
            old.close()  # replaced by a reconnect
        lead.sessions[member_id] = session
        carrier = session.carrier
        lead.leader.session_opened(member_id, now, carrier.key if carrier is not None else None)
        session.send(self._timing_event)
        # A member awaited since a takeover, or a joiner that can be asked
        # now: either may start a roll call (and the driver must wake for it).
        self._drain(lead)
        view = lead.coordinator.view
        if carrier is None:
            self._send_view(session, self._view_events(lead, view))
            self._tell_pace(lead, session)
            self._advise_agents(lead)
        else:
            # On a shared stream the member says which view it holds (its
            # holder shares views among its members): it is sent only what
            # it lacks, as a change where it can be one.
            session.announced = min(epoch, view.epoch)
            self._send_view(session, self._view_events(lead, view), opening=True)
        for other, (until, reason) in lead.leader.busy.items():
            if other != member_id and until > now:
                busy = pb.PeerBusy(member_id=other, seconds=until - now, reason=reason)
                session.send(pb.SessionEvent(busy=busy))
        rollcall = lead.coordinator.rollcall
        if rollcall is not None and rollcall.is_candidate(member_id) and member_id not in (
            rollcall.answers
        ):
            self._ask(session, rollcall.epoch)
        log.info("session open: %s (epoch %d)%s", member_id, epoch,
                 f" on shared session {carrier.key}" if carrier is not None else "")  # fmt: skip

    def _advise_agents(self, lead: Leadership) -> None:
        """Say once per leadership when more members than advised hold
        sessions of their own: each costs this process a stream and a
        heartbeat per interval, where a host agent's costs one per host."""
        if lead.agents_advised:
            return
        own = sum(1 for session in lead.sessions.values() if session.carrier is None)
        if own > self._config.own_sessions_advised:
            lead.agents_advised = True
            log.warning(
                "%d members hold sessions of their own: at this size run `rollcall agent` on "
                "each host and start the workers with --agent (docs/protocol.md, \"Shared "
                "sessions\"); one leader saturates at a few hundred such sessions", own,
            )  # fmt: skip

    # --- shared sessions --------------------------------------------------------------

    async def _shared_session(
        self,
        lead: Leadership,
        first: pb.SessionRequest,
        requests: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """A shared stream (``Open.shared``): the sessions of several
        members, each added by an Open, all under the stream's heartbeats."""
        carrier = Carrier(key=f"@{next(_CARRIER_NUMBERS)}", relayed=first.open.relayed)
        lead.carriers[carrier.key] = carrier
        lead.leader.carrier_opened(carrier.key, self._clock())
        interval = lead.leader.pace
        if interval != self._config.heartbeat_interval:
            carrier.send(self._pace_event(lead, interval))
        reader = asyncio.create_task(self._read_carrier(lead, carrier, first, requests))
        reader.add_done_callback(lambda _: carrier.outbox.put_nowait(READER_ENDED))
        ended = False
        try:
            while True:
                item = await carrier.outbox.get()
                if isinstance(item, bytes):
                    yield item
                    continue
                ended = True
                if item is READER_ENDED:
                    failure = None if reader.cancelled() else reader.exception()
                    if not isinstance(failure, RollcallError):
                        ended = False  # the stream broke, or its holder closed it
                        return
                    item = failure
                if isinstance(item, RollcallError):
                    await self._abort(context, item)
                return
        finally:
            reader.cancel()
            if lead.carriers.get(carrier.key) is carrier:
                del lead.carriers[carrier.key]
                for session in carrier.members.values():
                    if lead.sessions.get(session.member_id) is session:
                        del lead.sessions[session.member_id]
                # Broken (its holder killed, the connection cut): every
                # member on it is suspected, as its own stream breaking
                # would be, unless the holder only relayed them (their
                # processes may live on). Ended on a message this leader
                # refused: they may come back on another stream.
                broken = not ended and not carrier.relayed
                if not ended and carrier.relayed:
                    log.warning(
                        "shared session %s of a host agent broke: its %d members are "
                        "suspected unless they open their sessions again within %.1f s",
                        carrier.key, len(carrier.members), self._config.earliest_suspicion(),
                    )  # fmt: skip
                lead.leader.carrier_ended(carrier.key, self._clock(), broken=broken)
                self._drain(lead)

    async def _read_carrier(
        self,
        lead: Leadership,
        carrier: Carrier,
        first: pb.SessionRequest,
        requests: AsyncIterator[pb.SessionRequest],
    ) -> None:
        self._on_carried(lead, carrier, first)
        async for request in requests:
            if lead.carriers.get(carrier.key) is not carrier:
                return
            if request.WhichOneof("kind") != "batch":
                self._on_carried(lead, carrier, request)
                continue
            if request.slot:
                raise InvalidRequest("a batch is the stream's, it names no slot")
            for inner in request.batch.requests:
                if inner.WhichOneof("kind") == "batch":
                    raise InvalidRequest("a batch inside a batch")
                self._on_carried(lead, carrier, inner)

    def _on_carried(self, lead: Leadership, carrier: Carrier, request: pb.SessionRequest) -> None:
        """One message on a shared stream. A malformed one from the
        stream itself (an Open out of turn, a slot never opened) ends the
        stream; one that a member's own stream would end on ends that
        member's session only."""
        kind = request.WhichOneof("kind")
        slot = request.slot
        if kind == "open":
            if slot != carrier.opened + 1:
                raise InvalidRequest(
                    f"an Open on a shared session must name slot {carrier.opened + 1}, not {slot}"
                )
            carrier.opened = slot
            self._open_carried(lead, carrier, slot, request.open)
            return
        if slot == 0:
            if kind != "heartbeat":
                raise InvalidRequest("slot 0 of a shared session sends only heartbeats")
            sent_at = check.check_time(request.heartbeat.sent_at, "heartbeat sent_at")
            lead.leader.carrier_heard(carrier.key, self._clock())
            if sent_at:
                carrier.send(pb.SessionEvent(ack=pb.HeartbeatAck(sent_at=sent_at)))
            return
        if slot > carrier.opened:
            raise InvalidRequest(f"slot {slot} has not opened on this shared session")
        session = carrier.members.get(slot)
        if session is None or lead.sessions.get(session.member_id) is not session:
            return  # its session ended meanwhile: a message that crossed its end
        try:
            if kind == "close":
                close = request.close
                check.check_text(close.reason, "close reason", MAX_REASON)
                carrier.members.pop(slot, None)
                del lead.sessions[session.member_id]
                silent = close.why == pb.Close.SILENT
                if close.reason:
                    log.info("%s off shared session %s: %s", session.member_id, carrier.key,
                             close.reason)  # fmt: skip
                lead.leader.carried_closed(session.member_id, silent, self._clock())
                self._drain(lead)
            else:
                self._on_message(lead, session.member_id, request)
        except NotLeader:
            raise  # the whole stream goes to the leader
        except RollcallError as error:
            # As a member's own stream ends on a message refused: its
            # session ends, nothing else changes.
            if lead.sessions.get(session.member_id) is session:
                del lead.sessions[session.member_id]
                lead.leader.session_rejected(session.member_id, self._clock())
            session.close(error)

    def _open_carried(
        self, lead: Leadership, carrier: Carrier, slot: int, request: pb.Open
    ) -> None:
        """A member's Open on a shared stream. One refused (fence, secret)
        ends that member's session only (``SessionEnd``); a replica that
        does not lead ends the whole stream."""
        try:
            if not request.shared:
                raise InvalidRequest("every Open on a shared session says shared")
            opened, _ = self._opening(request)
            if opened is not lead:
                raise NotLeader(f"replica {self._advertise} led anew meanwhile")
        except NotLeader:
            raise
        except RollcallError as error:
            carrier.send(pb.SessionEvent(end=end_to_pb(error)), (slot,))
            return
        session = MemberSession(
            request.member_id, deltas=request.view_deltas, carrier=carrier, slot=slot
        )
        carrier.members[slot] = session
        self._seat(lead, session, request.epoch)

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
                lead.leader.answer(
                    member_id, answer.epoch, held, answer.digest, now, shards, answer.unsettled
                )
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
        elif kind in ("close", "batch"):
            raise InvalidRequest(f"{kind} is a message of shared sessions only")
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
