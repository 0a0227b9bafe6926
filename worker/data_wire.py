"""The frames of the state data channel (docs/protocol.md, "State data
channel"): what a worker's state server and a fetcher say to each other
over a plain TCP connection, as bytes in and values out. No sockets here.

Every length is checked against a bound before anything of that length is
read, so neither side allocates more than a bounded frame for a hostile
peer (a range's bytes go straight into the fetcher's own buffer). The
connection is admitted by a challenge: the server sends a fresh nonce, the
client answers with an HMAC of both nonces and of who it says it is, keyed
with the view's epoch secret (which never travels), and the server proves
that it knows the secret too.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

from rollcall.membership.errors import InvalidRequest

__all__ = [
    "GREETING",
    "HELLO",
    "MAX_MESSAGE",
    "NONCE_BYTES",
    "REQUEST",
    "STATUS",
    "Code",
    "Hello",
    "Kind",
    "Request",
    "Status",
    "client_proof",
    "server_proof",
]

#: The server's first bytes on every connection, then an answer whose
#: payload is its nonce (or a refusal: too many connections).
GREETING = b"rollcall.data.1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
#: The client's hello: job length, member id length, epoch, nonce, proof;
#: then the job and the member id (UTF-8).
HELLO = struct.Struct(f"<HHQ{NONCE_BYTES}s{PROOF_BYTES}s")
#: A request: kind, digest length, offset, length; then the digest (ASCII).
REQUEST = struct.Struct("<BBQQ")
#: Every answer: code, message length, payload length; then the message
#: (UTF-8) and the payload.
STATUS = struct.Struct("<BHQ")
#: Longest message an answer may carry.
MAX_MESSAGE = 1024


class Code(enum.IntEnum):
    """An answer's code: gRPC's numbers, with gRPC's meanings."""

    OK = 0
    INVALID_ARGUMENT = 3
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14


class Kind(enum.IntEnum):
    """What a request asks for."""

    #: The bytes [offset, offset + length) of the state with the digest.
    RANGE = 1
    #: The digests of every piece of that state (``rollcall.worker.pieces``).
    PIECES = 2


@dataclass(frozen=True)
class Hello:
    job: str
    member_id: str
    epoch: int
    nonce: bytes
    proof: bytes

    def encode(self) -> bytes:
        job, member = self.job.encode(), self.member_id.encode()
        fixed = HELLO.pack(len(job), len(member), self.epoch, self.nonce, self.proof)
        return fixed + job + member

    @staticmethod
    def lengths(fixed: bytes, max_id: int) -> tuple[int, int]:
        """The job's and the member id's lengths from a hello's fixed part;
        InvalidRequest if either is empty or longer than ``max_id``."""
        job_length, member_length, _, _, _ = HELLO.unpack(fixed)
        for what, length in (("job", job_length), ("member_id", member_length)):
            if not 0 < length <= max_id:
                raise InvalidRequest(f"{what} of {length} bytes (1..{max_id})")
        return job_length, member_length

    @classmethod
    def decode(cls, fixed: bytes, names: bytes) -> Hello:
        job_length, _, epoch, nonce, proof = HELLO.unpack(fixed)
        try:
            job, member_id = names[:job_length].decode(), names[job_length:].decode()
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"hello names that are not UTF-8: {exc}") from exc
        return cls(job, member_id, epoch, nonce, proof)


@dataclass(frozen=True)
class Request:
    kind: int
    digest: str
    offset: int
    length: int

    def encode(self) -> bytes:
        digest = self.digest.encode()
        return REQUEST.pack(self.kind, len(digest), self.offset, self.length) + digest

    @staticmethod
    def digest_length(fixed: bytes, max_digest: int) -> int:
        """The digest's length from a request's fixed part; InvalidRequest
        for an unknown kind or a digest longer than ``max_digest``."""
        kind, length, _, _ = REQUEST.unpack(fixed)
        if kind not in tuple(Kind):
            raise InvalidRequest(f"unknown request kind {kind}")
        if length > max_digest:
            raise InvalidRequest(f"digest is longer than {max_digest} characters")
        return length

    @classmethod
    def decode(cls, fixed: bytes, digest: bytes) -> Request:
        kind, _, offset, length = REQUEST.unpack(fixed)
        try:
            text = digest.decode("ascii")
        except UnicodeDecodeError as exc:
            raise InvalidRequest("digest has characters outside ASCII") from exc
        return cls(kind, text, offset, length)


@dataclass(frozen=True)
class Status:
    code: int
    message: str
    payload: int

    @staticmethod
    def encode(code: Code, message: str = "", payload: int = 0) -> bytes:
        text = message.encode()[:MAX_MESSAGE]
        return STATUS.pack(code, len(text), payload) + text

    @staticmethod
    def message_length(fixed: bytes) -> int:
        """The message's length from an answer's fixed part; InvalidRequest
        if it exceeds ``MAX_MESSAGE``."""
        _, length, _ = STATUS.unpack(fixed)
        if length > MAX_MESSAGE:
            raise InvalidRequest(f"answer with a message of {length} bytes (at most {MAX_MESSAGE})")
        return length

    @classmethod
    def decode(cls, fixed: bytes, message: bytes) -> Status:
        code, _, payload = STATUS.unpack(fixed)
        return cls(code, message.decode(errors="replace"), payload)


def client_proof(secret: str, server_nonce: bytes, hello: Hello) -> bytes:
    """What the client sends to show it holds ``secret`` (HMAC-SHA256)."""
    return _mac(secret, b"client", server_nonce, hello)


def server_proof(secret: str, server_nonce: bytes, hello: Hello) -> bytes:
    """What the server sends back to show it holds ``secret`` too."""
    return _mac(secret, b"server", server_nonce, hello)


def _mac(secret: str, side: bytes, server_nonce: bytes, hello: Hello) -> bytes:
    who = Hello(hello.job, hello.member_id, hello.epoch, hello.nonce, b"").encode()
    message = b"rollcall.data.1\0" + side + b"\0" + server_nonce + who
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()
