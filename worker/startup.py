"""Importing torch without losing a signal (no torch import here).

torch imports numpy from its C extension and drops any error that import
raises, KeyboardInterrupt included: a Ctrl-C that arrives in that moment
is lost, and a worker told to stop while it starts trains on. The entry
points of a training process (``from rollcall import Elastic``, ``rollcall
worker``) import torch through :func:`import_torch`
(tests/test_startup_signals.py).
"""

from __future__ import annotations

import signal
import sys


def import_torch() -> None:
    """Import torch, if no one has yet, with SIGINT and SIGTERM held back:
    one that arrives meanwhile is delivered the moment torch is in."""
    if "torch" in sys.modules:
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
