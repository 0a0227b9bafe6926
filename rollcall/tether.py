"""Run a command that dies with its parent.

    python -m rollcall.tether PARENT_PID COMMAND [ARGS...]

Sets PR_SET_PDEATHSIG to SIGKILL, checks the parent is still the one that
started us, then execs COMMAND (the setting survives exec). Children are
started through this instead of ``preexec_fn``, because ``preexec_fn`` forces
``subprocess`` to fork the whole interpreter, which runs gRPC's fork handlers
and can abort the child ("epoll_wait error: Bad file descriptor"); without it
``subprocess`` uses vfork and runs no handlers.

The kernel delivers the signal when the *thread* that started the child exits,
so start long-lived children from a long-lived thread (the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def tethered(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that the child is killed when this process dies."""
    return [sys.executable, "-m", "rollcall.tether", str(os.getpid()), *argv]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the tether was set
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
