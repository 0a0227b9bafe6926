"""Workers' sessions as a host agent relays them.

A worker that is told the agent's address (``Elastic(agent=...)``,
``$ROLLCALL_AGENT``, ``rollcall worker --agent``) opens its session on the
agent, exactly as it would on a replica. The agent puts it on its shared
stream to the leader (``SessionCarrier(relayed=True)``) and relays:

- the worker's messages go up in its slot, batched with the others';
  its heartbeats stay here: they feed the agent's own heartbeat detector
  (the same phi-accrual detector as the leader's, same settings), and the
  stream's heartbeats stand for every worker the agent still hears;
- the events for its slot come down as they are (the agent decodes no
  view); an acknowledgement of the stream's heartbeat goes to each worker
  as the acknowledgement of the newest heartbeat the agent had from it
  when that stream heartbeat left, so a worker's fence means what it means
  on a session of its own;
- a worker whose stream to the agent ends (its process died) is taken off
  the shared stream at once (``Close``: the leader suspects it as if its
  own stream broke); one the agent stops hearing for the detector's
  earliest suspicion is taken off as silent, and its stream is ended;
- while the agent cannot reach the leader for longer than
  ``session_open_timeout``, it ends its workers' streams (unavailable):
  they open their sessions on the replicas directly instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from rollcall.membership.config import Config
from rollcall.membership.detector import FailureDetector
from rollcall.membership.errors import (
    ControlPlaneUnavailable,
    Evicted,
    InvalidRequest,
    RollcallError,
)
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol import validation as check
from rollcall.protocol.carrier import SessionCarrier
from rollcall.protocol.wire import error_metadata, status_of

log = logging.getLogger("rollcall.agent")

#: Stream heartbeats remembered per worker, awaiting their acknowledgement.
_BEATS_KEPT = 64


class ReaderEnded:
    """Outbox item: the worker's side of its stream ended."""


class RelayedMember:
    """One worker's session, relayed on the agent's shared stream
    (``rollcall.protocol.carrier.Rider``)."""

    def __init__(self, job: str, request: pb.Open, now: float) -> None:
        self._job = job
        self._member_id = request.member_id
        self._secret = request.member_secret
        self._deltas = request.view_deltas
        #: What goes down the worker's own stream: events, or its end
        #: (an error, or None for a clean end).
        self.outbox: asyncio.Queue[bytes | RollcallError | ReaderEnded | None] = asyncio.Queue()
        #: When the agent last heard from the worker (its clock).
        self.heard_at = now
        #: The worker's newest heartbeat (the worker's own ``sent_at``).
        self._newest = 0.0
        #: Stream heartbeat -> the worker's newest heartbeat when it left.
        self._at_beat: dict[float, float] = {}
        self.ended = False

    @property
    def member_id(self) -> str | None:
        return self._member_id

    @property
    def closing(self) -> bool:
        return False  # a worker leaves with Leave, on the replicas directly

    def opening(self) -> pb.Open:
        # Epoch 0: the leader sends the view in force whole, which the
        # worker drops if it holds it (the agent does not follow its views).
        return pb.Open(
            job=self._job, member_id=self._member_id, epoch=0, member_secret=self._secret,
            view_deltas=self._deltas, shared=True,
        )  # fmt: skip

    def heard(self, sent_at: float, now: float) -> None:
        """A heartbeat of the worker (``sent_at`` on its clock)."""
        self._newest = max(self._newest, sent_at)
        self.heard_at = now

    def progress_due(self) -> pb.SessionRequest | None:
        return None  # the worker's progress comes as its own messages

    def beat(self, sent_at: float) -> None:
        if self._newest:
            self._at_beat[sent_at] = self._newest
            while len(self._at_beat) > _BEATS_KEPT:
                del self._at_beat[next(iter(self._at_beat))]

    def acked(self, sent_at: float) -> None:
        newest = self._at_beat.pop(sent_at, None)
        for older in [beat for beat in self._at_beat if beat < sent_at]:
            del self._at_beat[older]
        if newest is not None:
            ack = pb.SessionEvent(ack=pb.HeartbeatAck(sent_at=newest))
            self.outbox.put_nowait(ack.SerializeToString())

    def relay(self, event: bytes) -> None:
        self.outbox.put_nowait(event)

    def end(self, error: RollcallError | None) -> None:
        self.ended = True
        self.outbox.put_nowait(error)


class HostAgent(pb_grpc.RendezvousServicer):
    """The ``Session`` RPC of the rendezvous service, served to the workers
    of one host and carried on one shared stream (every other method is
    the replicas' own: workers call them there)."""

    def __init__(self, carrier: SessionCarrier, job: str, config: Config) -> None:
        self._carrier = carrier
        self._job = job
        self._config = config
        self._members: dict[str, RelayedMember] = {}
        self._detector = FailureDetector(config)
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._watch = asyncio.create_task(self._watch_members(), name="agent-watch")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for member in list(self._members.values()):
            member.end(ControlPlaneUnavailable("the host agent is stopping"))
        await self._carrier.close()

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        try:
            first = await anext(request_iterator)
            member = self._admit(first)
        except StopAsyncIteration:
            return
        except RollcallError as error:
            await _abort(context, error)
            return
        reader = asyncio.create_task(self._read(member, request_iterator))
        reader.add_done_callback(lambda _: member.outbox.put_nowait(ReaderEnded()))
        try:
            while True:
                item = await member.outbox.get()
                if isinstance(item, bytes):
                    yield item
                    continue
                if isinstance(item, ReaderEnded):
                    failure = None if reader.cancelled() else reader.exception()
                    if isinstance(failure, RollcallError):
                        await _abort(context, failure)
                    return
                if item is not None:
                    await _abort(context, item)
                return
        finally:
            reader.cancel()
            if self._members.get(member._member_id) is member:
                del self._members[member._member_id]
                self._detector.forget(member._member_id)
                if not member.ended:
                    # Its process ended or its link broke (or it is being
                    # ended here): the leader suspects it at once.
                    self._carrier.detach(member, reason="its session with the host agent ended")

    def _admit(self, first: pb.SessionRequest) -> RelayedMember:
        if first.WhichOneof("kind") != "open":
            raise InvalidRequest("a session must start with an Open message")
        request = first.open
        if request.shared:
            raise InvalidRequest("a host agent carries members' own sessions, not shared ones")
        check.check_id(request.job, "job", self._config)
        if request.job != self._job:
            raise InvalidRequest(f"this host agent serves job {self._job!r}, not {request.job!r}")
        check.check_id(request.member_id, "member_id", self._config)
        now = time.monotonic()
        old = self._members.pop(request.member_id, None)
        if old is not None:
            # Reconnected: its new Open replaces the old session on the
            # leader, and the old stream here ends cleanly.
            self._carrier.detach(old, quietly=True)
            old.end(None)
        member = RelayedMember(self._job, request, now)
        self._members[request.member_id] = member
        self._detector.watch(request.member_id, now)
        self._carrier.attach(member)
        log.info("session of %s relayed", request.member_id)
        return member

    async def _read(
        self, member: RelayedMember, requests: AsyncIterator[pb.SessionRequest]
    ) -> None:
        async for request in requests:
            if self._members.get(member._member_id) is not member:
                return
            now = time.monotonic()
            kind = request.WhichOneof("kind")
            if kind == "heartbeat":
                sent_at = check.check_time(request.heartbeat.sent_at, "heartbeat sent_at")
                member.heard(sent_at, now)
                self._detector.heartbeat(member._member_id, now)
            elif kind in ("open", "batch", "close") or request.slot:
                raise InvalidRequest(f"a member's own session sends no {kind or 'slot'}")
            else:
                member.heard_at = now
                self._detector.heartbeat(member._member_id, now)
                self._carrier.send(member, request)

    async def _watch_members(self) -> None:
        """Take silent workers off the stream, and send every worker to the
        replicas while the agent cannot reach the leader."""
        down_since: float | None = None
        while True:
            await asyncio.sleep(self._config.heartbeat_interval)
            now = time.monotonic()
            for member_id in self._detector.suspects(now):
                member = self._members.pop(member_id, None)
                self._detector.forget(member_id)
                if member is None:
                    continue
                silence = now - member.heard_at
                log.warning("%s silent for %.1f s: taken off the shared session", member_id,
                            silence)  # fmt: skip
                self._carrier.detach(member, silent=True,
                                     reason=f"no heartbeat for {silence:.1f} s")  # fmt: skip
                member.end(Evicted(f"member {member_id} silent for {silence:.1f} s; rejoin"))
            if self._carrier.connected or not self._members:
                down_since = None
                continue
            down_since = now if down_since is None else down_since
            if now - down_since > self._config.session_open_timeout and self._members:
                log.warning("the leader cannot be reached: %d workers sent to the replicas",
                            len(self._members))  # fmt: skip
                for member_id, member in list(self._members.items()):
                    del self._members[member_id]
                    self._detector.forget(member_id)
                    self._carrier.detach(member)
                    member.end(ControlPlaneUnavailable("the host agent cannot reach the leader"))


async def _abort(context: grpc.aio.ServicerContext, error: RollcallError) -> None:
    metadata = error_metadata(error)
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(status_of(error), str(error))
