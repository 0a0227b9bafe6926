"""The state data channel's sockets: a worker's ``DataServer`` (a listener
and one thread per connection) and a fetcher's ``DataConnection``.

State bytes move here, beside gRPC, because a gRPC stream copies every
message several times on each side: the server sends straight from its
snapshot (``socket.sendall`` of a memoryview) and the fetcher receives
straight into the buffer its tensors will view (``recv_into``). The frames
are ``rollcall.worker.data_wire``'s.

Every wait is bounded: each blocking call by ``transfer_stall_timeout``
(the kernel's SO_RCVTIMEO/SO_SNDTIMEO, so a peer that stops moving bytes
ends the call), a server by ``transfer_max_connections`` connections at
once, and its listener lives only while it is used
(``transfer_listener_idle``).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest, PermissionDenied, RollcallError
from rollcall.protocol.wire import status_of
from rollcall.worker.data_wire import (
    GREETING,
    HELLO,
    NONCE_BYTES,
    PROOF_BYTES,
    REQUEST,
    STATUS,
    Code,
    Hello,
    Request,
    Status,
    client_proof,
    server_proof,
)

__all__ = ["DataConnection", "DataHandler", "DataServer", "SourceFailed"]

log = logging.getLogger("rollcall.transfer")

#: How often the listener looks at whether it was closed or has been idle.
_ACCEPT_POLL = 0.5


class SourceFailed(RollcallError):
    """A source could not deliver over the data channel: unreachable, gone,
    too slow, refused (``code``, None for a transport failure) or speaking
    out of turn."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class DataHandler(Protocol):
    """What a ``DataServer`` asks its owner (the worker's state server)."""

    def admit_data(self, job: str, member_id: str, epoch: int) -> str | None:
        """The epoch secret a caller naming ``member_id`` in ``epoch`` must
        prove (None: none held); raises ``RollcallError`` to refuse it."""
        ...

    def answer_data(self, caller: Hello, request: Request) -> Sequence[Any]:
        """The buffers answering ``request`` of an admitted ``caller``;
        raises ``RollcallError`` to refuse it."""
        ...


def _configure(sock: socket.socket, stall: float) -> None:
    """Blocking, with every send and receive bounded by ``stall`` seconds
    without progress, and no small-frame delay."""
    sock.settimeout(None)
    seconds = int(stall)
    bound = struct.pack("ll", seconds, int((stall - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; OSError if the peer closes or stalls."""
    got, total = 0, len(view)
    while got < total:
        count = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if count == 0:
            raise ConnectionResetError(f"connection closed after {got} of {total} bytes")
        got += count


def _recv(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _recv_into(sock, memoryview(buffer))
    return bytes(buffer)


def _code_of(error: RollcallError) -> Code:
    value = status_of(error).value[0]
    return Code(value) if value in Code._value2member_map_ else Code.INTERNAL


class DataServer:
    """Serves the data channel for ``handler``. The listener is opened on
    demand (``port``) and closes itself after ``transfer_listener_idle``
    without a connection; ``close`` ends it and every connection now."""

    def __init__(self, handler: DataHandler, config: Config) -> None:
        self._handler = handler
        self._config = config
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._host: str | None = None
        self._connections: set[socket.socket] = set()
        self._used = time.monotonic()
        self._closed = False

    def port(self, host: str) -> int:
        """The port the data channel listens on at ``host``, opening it if
        it is not open (OSError if it cannot be)."""
        with self._lock:
            if self._closed:
                raise OSError("the data channel is closed")
            self._used = time.monotonic()
            if self._listener is not None and self._host != host:
                self._stop_listener()
            if self._listener is None:
                backlog = self._config.transfer_max_connections
                listener = socket.create_server((host, 0), backlog=backlog)
                listener.settimeout(_ACCEPT_POLL)
                self._listener, self._host = listener, host
                threading.Thread(
                    target=self._accept, args=(listener,), name="rollcall-data-accept", daemon=True
                ).start()
            return int(self._listener.getsockname()[1])

    def close(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        with self._lock:
            self._closed = True
            self._stop_listener()
            for conn in self._connections:
                _shutdown(conn)

    def _stop_listener(self) -> None:
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
            self._listener = None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                with self._lock:
                    idle = time.monotonic() - self._used > self._config.transfer_listener_idle
                    if self._listener is listener and idle and not self._connections:
                        self._stop_listener()
                        return
                continue
            except OSError:
                # Closed, or failing (out of descriptors, say): the next
                # Describe opens another listener.
                with self._lock:
                    if self._listener is listener:
                        self._stop_listener()
                return
            with self._lock:
                self._used = time.monotonic()
                full = len(self._connections) >= self._config.transfer_max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                self._refuse_busy(conn)
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="rollcall-data-serve", daemon=True
            ).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        busy = f"{self._config.transfer_max_connections} data connections already open"
        with conn:
            try:
                _configure(conn, self._config.transfer_stall_timeout)
                conn.sendall(GREETING + Status.encode(Code.RESOURCE_EXHAUSTED, busy))
            except OSError:
                pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            _configure(conn, self._config.transfer_stall_timeout)
            hello = self._admit(conn)
            while True:
                fixed = conn.recv(REQUEST.size, socket.MSG_WAITALL)
                if not fixed:
                    return  # the fetcher is done with this connection
                if len(fixed) < REQUEST.size:
                    raise InvalidRequest("request cut short")
                length = Request.digest_length(fixed, self._config.max_digest_length)
                request = Request.decode(fixed, _recv(conn, length))
                parts = self._handler.answer_data(hello, request)
                conn.sendall(Status.encode(Code.OK, payload=sum(len(p) for p in parts)))
                for part in parts:
                    conn.sendall(part)
        except RollcallError as error:
            try:
                conn.sendall(Status.encode(_code_of(error), str(error)))
            except OSError:
                pass
        except OSError:
            pass  # the fetcher went away or stalled: nothing to tell it
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket) -> Hello:
        """The challenge: the caller must prove the epoch secret of a view
        the handler admits it to. PermissionDenied (or the handler's own
        refusal) otherwise."""
        nonce = os.urandom(NONCE_BYTES)
        conn.sendall(GREETING + Status.encode(Code.OK, payload=NONCE_BYTES) + nonce)
        fixed = _recv(conn, HELLO.size)
        job_length, member_length = Hello.lengths(fixed, self._config.max_id_length)
        hello = Hello.decode(fixed, _recv(conn, job_length + member_length))
        secret = self._handler.admit_data(hello.job, hello.member_id, hello.epoch)
        expected = client_proof(secret or "", nonce, hello)
        if not secret or not hmac.compare_digest(hello.proof, expected):
            raise PermissionDenied(
                f"the connection naming member {hello.member_id} does not prove view "
                f"{hello.epoch}'s epoch secret: only the view's members may call this worker"
            )
        proof = server_proof(secret, nonce, hello)
        conn.sendall(Status.encode(Code.OK, payload=PROOF_BYTES) + proof)
        return hello


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class DataConnection:
    """A fetcher's connection to one source's data channel, admitted for
    (job, member_id, epoch). Its methods raise ``SourceFailed``; ``abort``
    (from any thread) makes a blocked call end at once."""

    def __init__(self, sock: socket.socket, source: str) -> None:
        self._sock = sock
        self.source = source

    @classmethod
    def open(
        cls, source: str, host: str, port: int, hello: Hello, secret: str, config: Config,
        timeout: float,
    ) -> DataConnection:  # fmt: skip
        """Connect (within ``timeout``) and pass the challenge; ``hello``'s
        nonce and proof are made here."""
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise SourceFailed(f"{source}: data channel {host}:{port} unreachable: {exc}") from exc
        conn = cls(sock, source)
        try:
            _configure(sock, min(timeout, config.transfer_stall_timeout))
            if conn._read(len(GREETING)) != GREETING:
                raise SourceFailed(f"{source}: not a rollcall data channel")
            conn._status(NONCE_BYTES, exact=True)
            server_nonce = conn._read(NONCE_BYTES)
            nonce = os.urandom(NONCE_BYTES)
            asked = Hello(hello.job, hello.member_id, hello.epoch, nonce, b"")
            proof = client_proof(secret, server_nonce, asked)
            conn._send(Hello(asked.job, asked.member_id, asked.epoch, nonce, proof).encode())
            conn._status(PROOF_BYTES, exact=True)
            expected = server_proof(secret, server_nonce, asked)
            if not hmac.compare_digest(conn._read(PROOF_BYTES), expected):
                raise SourceFailed(f"{source}: the server does not prove the epoch secret")
            _configure(sock, config.transfer_stall_timeout)
        except BaseException:
            conn.close()
            raise
        return conn

    def ask(self, request: Request, max_payload: int, exact: bool = False) -> int:
        """Send ``request``; the length of the payload that follows (at most
        ``max_payload``, exactly that with ``exact``)."""
        self._send(request.encode())
        return self._status(max_payload, exact)

    def read_into(self, view: memoryview) -> None:
        """Receive exactly ``len(view)`` payload bytes into ``view``."""
        try:
            _recv_into(self._sock, view)
        except OSError as exc:
            raise SourceFailed(f"{self.source}: data connection broke: {exc}") from exc

    def abort(self) -> None:
        _shutdown(self._sock)

    def close(self) -> None:
        self._sock.close()

    def _read(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.read_into(memoryview(buffer))
        return bytes(buffer)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise SourceFailed(f"{self.source}: data connection broke: {exc}") from exc

    def _status(self, max_payload: int, exact: bool) -> int:
        fixed = self._read(STATUS.size)
        try:
            length = Status.message_length(fixed)
        except InvalidRequest as exc:
            raise SourceFailed(f"{self.source}: {exc}") from exc
        status = Status.decode(fixed, self._read(length))
        if status.code != Code.OK:
            name = Code(status.code).name if status.code in Code._value2member_map_ else status.code
            raise SourceFailed(f"{self.source}: {name} {status.message}", status.code)
        if status.payload > max_payload or (exact and status.payload != max_payload):
            raise SourceFailed(
                f"{self.source}: answer of {status.payload} bytes, expected "
                f"{'' if exact else 'at most '}{max_payload}"
            )
        return status.payload
