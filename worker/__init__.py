"""The training runtime.

torch is imported here, first, with SIGINT and SIGTERM held back: torch
imports numpy from its C extension and drops any error that import
raises, so a Ctrl-C that arrives in that moment would be lost and a worker
told to stop while it starts would train on. Held back, the signal is
delivered the moment torch is in (tests/test_startup_signals.py).
"""

from __future__ import annotations

import signal

_held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
try:
    import torch  # noqa: F401
finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, _held)
    del _held
