"""rollcall: keep-alive membership for elastic PyTorch training.

The training runtime is imported from here::

    from rollcall import Elastic

Names are resolved on first use, so that the command line (``rollcall ...``)
starts without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: Public name -> module that defines it.
_EXPORTS = {
    "Elastic": "worker.runtime",
    "Step": "worker.runtime",
    "Batch": "worker.runtime",
    "default_collate": "worker.runtime",
    "Config": "membership.config",
    "RollcallError": "membership.errors",
    "UsageError": "membership.errors",
    "ViewChanged": "membership.errors",
    "Interrupted": "membership.errors",
    "Evicted": "membership.errors",
    "CannotResume": "membership.errors",
    "ProgressLost": "membership.errors",
    "ConfigurationMismatch": "membership.errors",
    "UnsafeFenceWindow": "membership.errors",
    "CheckpointUnusable": "worker.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollcall' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
