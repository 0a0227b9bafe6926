"""What the leader holds per member session, and everything that exists
only while a replica leads (its policy, the members' etcd records, the open
sessions, the commits under way)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollcall.membership.cause import Cause
from rollcall.membership.coordinator import Coordinator
from rollcall.membership.errors import NotLeader, RollcallError
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.membership.leader import Leader
from rollcall.membership.view import Member, View
from rollcall.pb import rendezvous_pb2 as pb
from rollcall.protocol.wire import end_to_pb
from rollcall.rendezvous.store import LeaderInfo, MemberRecord


class ReaderEnded:
    """Outbox item: the session's reading side ended (``READER_ENDED``)."""


READER_ENDED = ReaderEnded()


Outbox = asyncio.Queue[pb.SessionEvent | bytes | RollcallError | ReaderEnded | None]


def addressed(event: pb.SessionEvent | bytes, slots: Iterable[int]) -> bytes:
    """``event`` encoded for the members ``slots`` of a shared stream
    (none: every member on it). Two encoded messages one after the other
    decode as one message with the fields of both, so an event encoded
    once for many streams gets its addressees appended, not re-encoded."""
    encoded = event if isinstance(event, bytes) else event.SerializeToString()
    slots = list(slots)
    return encoded + pb.SessionEvent(slots=slots).SerializeToString() if slots else encoded


@dataclass
class Carrier:
    """A shared session stream on the leader: the sessions of several
    members of one process or one host (``Open.shared``;
    docs/protocol.md, "Shared sessions"). Its heartbeats stand for every
    member on it: the detector watches the stream (``key``), not each
    member."""

    #: The detector's name for the stream (no member id starts with "@").
    key: str
    outbox: Outbox = field(default_factory=asyncio.Queue)
    #: The members on the stream by slot (their Open's place on it).
    members: dict[int, MemberSession] = field(default_factory=dict)
    #: Opens seen on the stream: the next Open's slot is this plus one.
    opened: int = 0
    #: Its members' sessions are relayed from other processes (a host
    #: agent, ``Open.relayed``): the stream breaking suspects none of them.
    relayed: bool = False

    def send(self, event: pb.SessionEvent | bytes, slots: Iterable[int] = ()) -> None:
        """Queue an event for the members ``slots`` (none: all of them)."""
        self.outbox.put_nowait(addressed(event, slots))

    def close(self, error: RollcallError | None = None) -> None:
        """End the whole stream: cleanly (None) or with the error's status."""
        self.outbox.put_nowait(error)


@dataclass
class MemberSession:
    """An open session of one member on the leader: a stream of its own,
    or its slot on a shared one (``carrier``)."""

    member_id: str
    #: Whether the member applies views sent as changes (``Open.view_deltas``).
    deltas: bool = False
    outbox: Outbox = field(default_factory=asyncio.Queue)
    asked_epoch: int = 0  # last roll call sent on this session
    #: Epoch of the last view sent on this session (whole or as a change).
    announced: int = 0
    #: The shared stream the session is on, and its slot there (None: a
    #: stream of its own).
    carrier: Carrier | None = None
    slot: int = 0

    def send(self, event: pb.SessionEvent | bytes) -> None:
        """Queue an event, or one already encoded (sent as it is)."""
        if self.carrier is not None:
            self.carrier.send(event, (self.slot,))
        else:
            self.outbox.put_nowait(event)

    def close(self, error: RollcallError | None = None) -> None:
        """End the session: cleanly (None) or with the error's status. On
        a shared stream that is a ``SessionEnd`` to its slot (the others go
        on), unless the error is that this replica does not lead: that ends
        the stream, whose members all move to the leader together."""
        carrier = self.carrier
        if carrier is None:
            self.outbox.put_nowait(error)
            return
        carrier.members.pop(self.slot, None)
        if isinstance(error, NotLeader):
            carrier.close(error)
        elif error is not None:
            carrier.send(pb.SessionEvent(end=end_to_pb(error)), (self.slot,))
        else:
            carrier.send(pb.SessionEvent(end=pb.SessionEnd()), (self.slot,))


@dataclass(frozen=True)
class Announcement:
    """The events announcing one view, each encoded once: the view as a
    message, its epoch secret
    (for the view's members only), the whole view, and the view as a change
    of view ``base_epoch`` (None when it cannot be said as one)."""

    view: View
    #: The view as a message (a ``JoinResponse`` copies it).
    message: pb.View
    secret: bytes
    whole: bytes
    delta: bytes | None
    #: The change with the epoch secret in it, for the view's members.
    delta_with_secret: bytes | None
    base_epoch: int


@dataclass
class Leadership:
    """Everything that exists only while this replica is the leader."""

    info: LeaderInfo
    #: The leader's policy (it owns the coordinator and the detector).
    leader: Leader
    view_revision: int
    records: dict[str, MemberRecord]
    sessions: dict[str, MemberSession] = field(default_factory=dict)
    #: The shared session streams open on this leader, by ``Carrier.key``.
    carriers: dict[str, Carrier] = field(default_factory=dict)
    #: Whether the leader said that the members' hosts should run agents.
    agents_advised: bool = False
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
    #: Members removed while etcd did not answer: their secret hashes (kept
    #: without a lease) are deleted once it does (``Election._keep_alive``).
    unremoved: set[str] = field(default_factory=set)
    #: The events announcing the last view announced (``_view_events``),
    #: encoded once however many sessions receive them.
    announcing: Announcement | None = None
    #: The roll-call request last sent, encoded: (epoch, causes, bytes).
    asking: tuple[int, tuple[Cause, ...], bytes] | None = None
    #: The heartbeat interval last told to the members, and its event encoded.
    pace: tuple[float, bytes] | None = None
    #: Joiners waiting for their etcd record, written in batches
    #: (``MemberCalls._record_members``), and the task writing them.
    enrolling: list[tuple[Member, str, asyncio.Future[MemberRecord]]] = field(
        default_factory=list
    )
    enroller: asyncio.Task[None] | None = None
    #: The job's fingerprint as this leader last confirmed it in etcd (read
    #: or written while admitting a joiner): a joiner with exactly this one
    #: is admitted without reading etcd again, and without waiting for
    #: other admissions.
    admitted: JobFingerprint | None = None
    #: Fingerprinted joiners admitted whose records are being written: they
    #: count as joiners when another fingerprint is judged (the job is not
    #: empty).
    admitted_joining: int = 0

    @property
    def coordinator(self) -> Coordinator:
        return self.leader.coordinator
