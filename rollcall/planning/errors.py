"""Named errors of the planning core. Each is a ``ValueError`` too, so a
command line shows it as one line."""

from __future__ import annotations

from rollcall.membership.errors import RollcallError


class PlanningError(RollcallError, ValueError):
    """Base of the planning core's errors."""


class BadJob(PlanningError):
    """A job, host or fault-mix setting is out of range (a negative time, zero
    ranks, a share above 1): fix the input."""


class CostsUnreadable(PlanningError):
    """A benchmark result or the shipped costs file lacks a field the cost
    model needs, or holds something that is not a number where one is due:
    rerun the benchmark or regenerate the costs (bench/simulate.py)."""
