"""The TCP connections of a gloo group: found when it is built, shut down to
abort a collective blocked on them.

gloo has no working abort, but a blocked call returns within milliseconds
(here and on every peer) once the group's connected sockets are shut down
(never closed: the descriptors are gloo's). They are told apart from the
process's other connections by comparing the process's sockets before and
after the build against every rank's gloo listener.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

__all__ = ["Connection", "connections_of", "endpoint", "tcp_sockets"]


def tcp_sockets() -> list[Any]:
    return list(psutil.Process().net_connections(kind="tcp"))


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
        sock = socket.socket(fileno=copy)
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
    before: set[int], after: Sequence[Any], listeners: set[tuple[str, int]]
) -> tuple[tuple[str, int] | None, list[Connection]]:
    """This rank's gloo listener (the one new listening socket) and the
    group's own connections among ``after`` (psutil's connections): new
    since ``before`` and either accepted on our listener or connected to a
    peer's (``listeners``). gRPC or metrics connections made meanwhile by
    other threads match neither."""
    new = [c for c in after if c.fd not in before and c.fd >= 0]
    own = [c for c in new if c.status == psutil.CONN_LISTEN]
    listener = endpoint(own[0].laddr) if len(own) == 1 else None
    connections = [
        Connection(c.fd, endpoint(c.laddr), endpoint(c.raddr))
        for c in new
        if c.status == psutil.CONN_ESTABLISHED
        and c.raddr
        and (
            (listener is not None and c.laddr.port == listener[1]) or endpoint(c.raddr) in listeners
        )
    ]
    return listener, connections
