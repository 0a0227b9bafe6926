"""One session stream shared by several members of this process.

Every member's own session costs the leader a stream, a heartbeat every
interval and an acknowledgement of it. A ``SessionCarrier`` carries the
sessions of the members of one process (or, behind a host agent, of one
host) on one stream (docs/protocol.md, "Shared sessions"): each member is
opened on it with an ``Open`` of its own (its member secret, fenced as on
its own stream) and gets a slot; the stream's heartbeats stand for all of
them and are acknowledged once; events name the slots they are for, so a
view or a roll call crosses the wire once per stream, and the members'
messages go up batched.

A member uses it by being given it (``RendezvousClient(..., carrier=c)``):
its ``join``, ``leave`` and every other call are as before, only its
session runs here. A member dropped without leaving (``close``) is taken
off the stream with ``Close``, which the leader treats as a member's own
stream breaking: it is suspected at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from rollcall.membership.config import Config
from rollcall.membership.errors import Evicted, RollcallError, StaleEpoch
from rollcall.membership.view import EMPTY_VIEW, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol.client import (
    Answering,
    ClientTLS,
    RendezvousClient,
    ReplicaSet,
    error_from_end,
    paced,
)
from rollcall.protocol.wire import causes_from_pb, delta_from_pb, view_from_pb

log = logging.getLogger("rollcall.client")

#: The most messages sent as one ``SessionBatch``, and the most bytes: the
#: service refuses a message above ``Config.max_message_bytes`` (64 KiB).
BATCH_MESSAGES = 512
BATCH_BYTES = 32 * 1024


class Rider(Protocol):
    """A member whose session a ``SessionCarrier`` carries and that is not
    a ``RendezvousClient`` of this process: one relayed from another
    process by a host agent (``rollcall.agent``). Its events are handed on
    encoded, without their slots."""

    @property
    def member_id(self) -> str | None: ...

    def opening(self) -> pb.Open:
        """Its Open on a (new) stream, ``shared`` set."""
        ...

    @property
    def closing(self) -> bool:
        """Whether it is leaving (a clean end of its session is no news)."""
        ...

    def progress_due(self) -> pb.SessionRequest | None:
        """A message to send with the stream's next heartbeat, if any."""
        ...

    def beat(self, sent_at: float) -> None:
        """The stream's heartbeat of ``sent_at`` was written."""
        ...

    def acked(self, sent_at: float) -> None:
        """The leader acknowledged the stream's heartbeat of ``sent_at``,
        sent after this member was opened on it."""
        ...

    def relay(self, event: bytes) -> None:
        """An event of its session, encoded."""
        ...

    def end(self, error: RollcallError | None) -> None:
        """The leader ended its session: with ``error``, or cleanly."""
        ...


Carried = RendezvousClient | Rider


@dataclass(frozen=True)
class _Message:
    """Queued: a member's message, sent in the member's slot on the stream
    up when it is written (a slot number of an earlier stream would name
    another member on this one)."""

    member: Carried
    request: pb.SessionRequest


@dataclass(frozen=True)
class _Opening:
    """Queued: the Open of a member attached while the stream was up."""

    member: Carried


@dataclass(frozen=True)
class _Closing:
    """Queued: a member off the stream (``stream``: which one it was on)."""

    stream: int
    request: pb.SessionRequest


_Queued = _Message | _Opening | _Closing | None


class SessionCarrier(ReplicaSet):
    """The shared session stream of this process's members, across
    replica failovers (``Open.shared``)."""

    def __init__(
        self,
        addresses: Sequence[str],
        job: str,
        token: str,
        config: Config | None = None,
        tls: ClientTLS | None = None,
        relayed: bool = False,
    ) -> None:
        """``relayed``: the members live in other processes (``Rider``s of
        a host agent), so a broken stream is no evidence against them."""
        super().__init__(addresses, job, token, config, tls)
        self._relayed = relayed
        #: The members attached, in the order they were.
        self._members: list[Carried] = []
        #: On the current stream: each member's slot, and who is in each.
        self._slot_of: dict[int, int] = {}  # id(member) -> slot
        self._in_slot: dict[int, Carried] = {}
        self._opened = 0
        #: When each member's Open was written on the current stream: an
        #: acknowledgement of a heartbeat sent before it does not vouch
        #: for the member (the leader did not count it yet).
        self._open_sent: dict[int, float] = {}
        self._streaming = False
        #: The members' answers under way on the stream (``Answering``).
        self._answering = Answering()
        #: Whether a stream is up and its replica answered.
        self.connected = False
        #: Which stream is up (each new one is counted).
        self._stream = 0
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._interval = self._config.heartbeat_interval
        self._task: asyncio.Task[None] | None = None
        self._attached = asyncio.Event()
        self._closing = False
        #: The newest view received on the stream, shared by its members: a
        #: member attached later opens with it and is sent only what it lacks.
        self.view: View = EMPTY_VIEW
        #: Send time of the newest heartbeat of the stream the leader
        #: acknowledged (``RendezvousClient.last_acked`` of every member).
        self.last_acked = 0.0

    @property
    def members(self) -> tuple[Carried, ...]:
        return tuple(self._members)

    @property
    def heartbeat_interval(self) -> float:
        return self._interval

    # --- members come and go ------------------------------------------------------

    def attach(self, member: Carried) -> None:
        """Carry ``member``'s session (after its Join): it is opened on the
        stream now if the stream is up, else when it is."""
        if self._closing:
            raise RuntimeError("the session carrier is closed")
        if isinstance(member, RendezvousClient) and self.view.epoch > member.view.epoch:
            member._set_view(self.view)  # the newest view any member here holds
        self._members.append(member)
        if self._streaming:
            self._seat(member)
            self._queue.put_nowait(_Opening(member))  # its Open, in turn
        self._attached.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._forever(), name="shared-session")

    def detach(
        self, member: Carried, silent: bool = False, reason: str = "", quietly: bool = False
    ) -> None:
        """Stop carrying ``member``'s session: off the stream with
        ``Close`` (``silent``: nothing was heard from it), which suspects it
        if it is still in the job (a member that left is not); ``quietly``:
        without, for a member whose session opens again at once (the
        leader ends the old one itself then)."""
        if member not in self._members:
            return
        self._members.remove(member)
        slot = self._slot_of.pop(id(member), None)
        self._open_sent.pop(id(member), None)
        if slot is not None:
            self._in_slot.pop(slot, None)
        if slot is not None and not quietly:
            why = pb.Close.SILENT if silent else pb.Close.ENDED
            request = pb.SessionRequest(slot=slot, close=pb.Close(why=why, reason=reason[:256]))
            self._queue.put_nowait(_Closing(self._stream, request))

    def send(self, member: Carried, request: pb.SessionRequest) -> None:
        """A message of ``member``'s session, sent in its slot of the
        stream up when it is written; kept while no stream is up."""
        self._queue.put_nowait(_Message(member, request))

    async def close(self) -> None:
        """End the stream (members still on it are dropped, as by
        ``detach``) and close the channels."""
        self._closing = True
        for member in list(self._members):
            self.detach(member)
        task, self._task = self._task, None
        if task is not None:
            self._queue.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(task), self._config.etcd_close_wait)
            except (TimeoutError, asyncio.CancelledError):
                pass
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._close_channels()

    def _seat(self, member: Carried) -> int:
        """Give ``member`` the next slot of the current stream."""
        self._opened += 1
        slot = self._opened
        self._slot_of[id(member)] = slot
        self._in_slot[slot] = member
        return slot

    # --- the stream ------------------------------------------------------------------

    async def _forever(self) -> None:
        backoff = self._retry_backoff()
        while not self._closing:
            if not self._members:
                self._attached.clear()
                await self._attached.wait()
                continue
            ended = await self._round(
                self._stream_on, backoff, lambda: not self._closing and bool(self._members)
            )
            if ended is not None:
                self._end_all(ended)
                return
            if self._members and not self._closing:
                await asyncio.sleep(backoff.next())

    def _end_all(self, error: RollcallError) -> None:
        for member in list(self._members):
            self._members.remove(member)
            _end(member, error)

    async def _stream_on(self, address: str) -> bool:
        """Hold the shared stream on ``address`` until it ends; whether the
        replica answered. ``TimeoutError`` if it does not within
        ``session_open_timeout``."""
        if not self._members:
            return False  # a shared stream starts with a member's Open
        call = self._stub(address).Session(metadata=self._metadata)
        self._slot_of.clear()
        self._in_slot.clear()
        self._open_sent.clear()
        self._opened = 0
        self._stream += 1
        # Seated at once: a member attached while these Opens are written
        # is opened after them, through the queue.
        seated = [(member, self._seat(member)) for member in self._members]
        self._streaming = True
        opened = False
        writer: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(self._config.session_open_timeout):
                now = time.monotonic()
                for member, slot in seated:
                    await call.write(self._open_request(member, slot))
                    self._opened_at(member, now)
                # Its acknowledgement says the replica answered.
                await call.write(pb.SessionRequest(heartbeat=pb.Heartbeat(sent_at=now)))
                event = await call.read()
            writer = asyncio.create_task(self._write(call, now + self._interval))
            while True:
                if event is grpc.aio.EOF:
                    return opened
                opened = self.connected = True
                self._leader_hint = address
                await self._dispatch(event)
                event = await call.read()
                self._answering.check()
        finally:
            self._streaming = self.connected = False
            for member in self._members:
                if isinstance(member, RendezvousClient):
                    member.session_opened = None
            call.cancel()
            await self._answering.stop()
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)

    async def _write(self, call: grpc.aio.StreamStreamCall, next_beat: float) -> None:
        """Send the members' messages, batched, and the stream's heartbeat
        every interval (after the members' progress, so that a heartbeat
        that is acknowledged has carried it)."""
        while True:
            item: _Queued
            try:
                async with asyncio.timeout(max(0.0, next_beat - time.monotonic())):
                    item = await self._queue.get()
            except TimeoutError:
                item = None
            now = time.monotonic()
            batch: list[pb.SessionRequest] = []
            while item is not None:
                self._take(item, batch, now)
                if len(batch) >= BATCH_MESSAGES or self._queue.empty():
                    break
                item = self._queue.get_nowait()
            if now >= next_beat:
                next_beat = now + self._interval
                for member in self._members:
                    slot = self._slot_of.get(id(member))
                    if slot is None:
                        continue
                    if isinstance(member, RendezvousClient):
                        progress = member._progress_due()
                    else:
                        progress = member.progress_due()
                        member.beat(now)
                    if progress is not None:
                        progress.slot = slot
                        batch.append(progress)
                batch.append(pb.SessionRequest(heartbeat=pb.Heartbeat(sent_at=now)))
            try:
                for message in _batches(batch):
                    await call.write(message)
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                return  # the stream ended; the reader says why

    def _take(self, item: _Queued, batch: list[pb.SessionRequest], now: float) -> None:
        """A queued item as the messages to write now."""
        if isinstance(item, _Message):
            slot = self._slot_of.get(id(item.member))
            # Every member attached is seated on the stream up: one
            # without a slot was detached meanwhile.
            if slot is not None:
                item.request.slot = slot
                batch.append(item.request)
        elif isinstance(item, _Opening):
            slot = self._slot_of.get(id(item.member))
            if slot is not None:  # (not detached again meanwhile)
                batch.append(self._open_request(item.member, slot))
                self._opened_at(item.member, now)
        elif isinstance(item, _Closing) and item.stream == self._stream:
            batch.append(item.request)

    def _opened_at(self, member: Carried, now: float) -> None:
        """``member``'s Open was written on the stream at ``now``."""
        self._open_sent[id(member)] = now
        if isinstance(member, RendezvousClient):
            member.session_opened = now

    def _open_request(self, member: Carried, slot: int) -> pb.SessionRequest:
        if not isinstance(member, RendezvousClient):
            opening = member.opening()
            opening.relayed = self._relayed
            return pb.SessionRequest(slot=slot, open=opening)
        return pb.SessionRequest(
            slot=slot, open=member._opening(shared=True, relayed=self._relayed)
        )

    async def _dispatch(self, event: pb.SessionEvent) -> None:
        """One event of the stream: the stream's own (no slots), or for the
        members it names, decoded once for all of them."""
        kind = event.WhichOneof("kind")
        if not event.slots:
            if kind == "ack":
                sent_at = event.ack.sent_at
                self.last_acked = max(self.last_acked, sent_at)
                for member in self._members:
                    if self._open_sent.get(id(member), float("inf")) <= sent_at:
                        if isinstance(member, RendezvousClient):
                            member.last_acked = max(member.last_acked, sent_at)
                        else:
                            member.acked(sent_at)
            elif kind == "pace":
                self._pace(event.pace.heartbeat_interval_ms)
            return
        addressed = [m for m in (self._in_slot.get(s) for s in event.slots) if m is not None]
        riders = [m for m in addressed if not isinstance(m, RendezvousClient)]
        # (One that refused the leader's timing acts on nothing more: it leaves.)
        members = [m for m in addressed if isinstance(m, RendezvousClient) and not m.refused_leader]
        if riders and kind != "end":
            # Handed on as they came, for a process that reads them itself.
            plain = pb.SessionEvent()
            plain.CopyFrom(event)
            plain.ClearField("slots")
            encoded = plain.SerializeToString()
            for rider in riders:
                rider.relay(encoded)
        if kind == "end":
            for member in addressed:
                self._ended(member, event.end)
        elif not members:
            return
        elif kind == "view":
            if all(event.view.epoch <= m.view.epoch for m in members):
                return
            # One view per epoch: the one the carrier holds is the one sent
            # (members opening in a burst are each sent the whole view).
            known = self.view
            view = known if known.epoch == event.view.epoch else view_from_pb(event.view)
            self._share(view)
            for member in members:
                member._set_view(view)
        elif kind == "view_delta":
            change = event.view_delta
            delta = delta_from_pb(change)
            for member in members:
                if change.epoch_secret:
                    member._keep_epoch_secret(change.epoch, change.epoch_secret)
                member._apply_delta(delta)
                self._share(member.view)
        elif kind == "roll_call":
            request = event.roll_call
            causes = causes_from_pb(request.causes)
            self._answering.start(
                asyncio.gather(*(m._answer(request.epoch, causes, request.at_step_end)
                                 for m in members))  # fmt: skip
            )
        else:
            for member in members:
                await member._on_event(event)

    def _share(self, view: View) -> None:
        if view.epoch > self.view.epoch:
            self.view = view

    def _ended(self, member: Carried, end: pb.SessionEnd) -> None:
        """The leader ended ``member``'s session (the others go on)."""
        slot = self._slot_of.pop(id(member), None)
        if slot is not None:
            self._in_slot.pop(slot, None)
        self._open_sent.pop(id(member), None)
        if member not in self._members:
            return
        self._members.remove(member)
        if end.code == 0:
            # Ended cleanly: the member left, or its session was replaced.
            # A member of this process that did neither opens again; a
            # relayed one's own stream ends (its process opens it again).
            if isinstance(member, RendezvousClient):
                if not member._closing:
                    self.attach(member)
            else:
                member.end(None)
            return
        error = error_from_end(end)
        _end(member, Evicted(str(error)) if isinstance(error, StaleEpoch) else error)

    def _pace(self, interval_ms: int) -> None:
        """The stream heartbeats as the leader says, within the members'
        fence window (as a member's own session does)."""
        self._interval = paced(self._config, interval_ms, self._interval)


def _end(member: Carried, error: RollcallError) -> None:
    if isinstance(member, RendezvousClient):
        member._end(error)
    else:
        member.end(error)


def _batches(requests: list[pb.SessionRequest]) -> list[pb.SessionRequest]:
    """``requests`` as messages to write: alone, or several as one
    ``SessionBatch`` of at most ``BATCH_BYTES``."""
    if len(requests) <= 1:
        return requests
    messages: list[pb.SessionRequest] = []
    batch = pb.SessionBatch()
    size = 0
    for request in requests:
        length = request.ByteSize() + 4
        if batch.requests and size + length > BATCH_BYTES:
            messages.append(pb.SessionRequest(batch=batch))
            batch, size = pb.SessionBatch(), 0
        batch.requests.append(request)
        size += length
    if len(batch.requests) == 1:
        messages.append(batch.requests[0])
    elif batch.requests:
        messages.append(pb.SessionRequest(batch=batch))
    return messages
