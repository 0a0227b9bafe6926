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
    "Elastic": "rollcall.worker.runtime",
    "Step": "rollcall.worker.runtime",
    "Batch": "rollcall.worker.runtime",
    "default_collate": "rollcall.worker.runtime",
    "Config": "rollcall.membership.config",
    "RollcallError": "rollcall.membership.errors",
    "UsageError": "rollcall.membership.errors",
    "ViewChanged": "rollcall.membership.errors",
    "Interrupted": "rollcall.membership.errors",
    "Evicted": "rollcall.membership.errors",
    "CannotResume": "rollcall.membership.errors",
    "ProgressLost": "rollcall.membership.errors",
    "StateDrifted": "rollcall.membership.errors",
    "NonFiniteGradient": "rollcall.membership.errors",
    "ConfigurationMismatch": "rollcall.membership.errors",
    "UnsafeTiming": "rollcall.membership.errors",
    "UnsafeFenceWindow": "rollcall.membership.errors",
    "UnsafeFencePatience": "rollcall.membership.errors",
    "UnsafeStepEndWait": "rollcall.membership.errors",
    "CheckpointUnusable": "rollcall.worker.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollcall' has no attribute {name!r}")
    if module.startswith("rollcall.worker."):
        from rollcall.worker.startup import import_torch

        import_torch()
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
