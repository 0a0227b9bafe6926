"""The TCP connections of a gloo group: found when it is built, shut down to
abort a collective blocked on them.

gloo has no working abort, but a blocked call returns within milliseconds
(here and on every peer) once the group's connected sockets are shut down
(never closed: the descriptors are gloo's). They are told apart from the
process's other connections by comparing the process's sockets before and
after the build against every rank's gloo listener.

The process's sockets are listed from its own descriptors (``/proc/self/fd``,
then each new socket asked for its ends), not from the kernel's connection
tables: reading ``/proc/net/tcp`` walks the whole table, ~2 ms per file here
however few sockets the process has, on the path of every view change.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Connection", "Socket", "connections_of", "endpoint", "socket_ids", "tcp_sockets"]

#: ``tcpi_state`` of an established connection (linux/tcp.h's TCP_ESTABLISHED).
_ESTABLISHED = 1


@dataclass(frozen=True)
class Socket:
    """One TCP socket of this process: its descriptor, its inode (so that a
    descriptor closed and reused meanwhile is not taken for the same
    socket), whether it listens, and its ends (``peer`` None unless it is
    connected)."""

    fd: int
    inode: int
    listening: bool
    local: tuple[str, int]
    peer: tuple[str, int] | None


def socket_ids() -> set[tuple[int, int]]:
    """(descriptor, inode) of every socket this process holds now."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add((int(name), int(target[8:-1])))
    return found


def tcp_sockets(skip: Collection[tuple[int, int]] = ()) -> list[Socket]:
    """This process's TCP sockets (IPv4 and IPv6) but those in ``skip``
    (``socket_ids()`` taken earlier): listening, or established."""
    out = []
    for fd, inode in socket_ids() - set(skip):
        described = _describe(fd, inode)
        if described is not None:
            out.append(described)
    return out


def _describe(fd: int, inode: int) -> Socket | None:
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None
    try:
        if os.fstat(copy).st_ino != inode:
            return None  # the descriptor was reused by another file meanwhile
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.type != socket.SOCK_STREAM:
            return None
        local = endpoint(sock.getsockname())
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return Socket(fd, inode, True, local, None)
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        if struct.unpack_from("B", info)[0] != _ESTABLISHED:
            return None
        return Socket(fd, inode, False, local, endpoint(sock.getpeername()))
    except OSError:  # not connected, or gone meanwhile
        return None
    finally:
        sock.close()


@dataclass(frozen=True)
class Connection:
    """One of the group's TCP connections: its descriptor and both ends, so
    that a descriptor gloo closed and the process reused for another socket
    is never mistaken for it."""

    fd: int
    local: tuple[str, int]
    peer: tuple[str, int]

    def shut_down(self) -> bool:
        """Shut the connection down if the descriptor still holds it; True if
        it did. The descriptor is duplicated first, so the check and the
        shutdown see one and the same socket."""
        try:
            copy = os.dup(self.fd)
        except OSError:
            return False  # closed by gloo already
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # the number now holds a file or a pipe
            os.close(copy)
            return False
        try:
            if endpoint(sock.getsockname()) != self.local:
                return False
            if endpoint(sock.getpeername()) != self.peer:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:  # not a socket any more, or no longer connected
            return False
        finally:
            sock.close()


def endpoint(address: Any) -> tuple[str, int]:
    host, port = address[0], address[1]
    return (str(host).removeprefix("::ffff:"), int(port))


def connections_of(
    after: Sequence[Socket],
    listeners: Collection[tuple[str, int]],
    listener: tuple[str, int] | None = None,
) -> tuple[tuple[str, int] | None, list[Connection]]:
    """This rank's gloo listener and the group's own connections among
    ``after``, the sockets that are new since before the group's device was
    made (``tcp_sockets(skip=...)``): those accepted on our listener or
    connected to a peer's (``listeners``). The listener is ``listener`` if
    given (found when the device was made), else the one listening socket
    among ``after``. gRPC, metrics or data-channel sockets made meanwhile
    by other threads match neither."""
    own = [c for c in after if c.listening]
    if listener is None and len(own) == 1:
        listener = own[0].local
    connections = [
        Connection(c.fd, c.local, c.peer)
        for c in after
        if c.peer is not None
        and ((listener is not None and c.local[1] == listener[1]) or c.peer in listeners)
    ]
    return listener, connections
