"""Named errors of the control plane. Each tells the caller what to do."""

from __future__ import annotations


class RollcallError(Exception):
    """Base of every error rollcall raises on purpose."""


class InvalidRequest(RollcallError):
    """The request is malformed (bad id, address, size, field); fix the caller."""


class Unauthenticated(RollcallError):
    """The job token is missing or wrong."""


class StaleEpoch(RollcallError):
    """The request belongs to an epoch the sender is no longer part of:
    the sender must rejoin before it may act again."""


class NotAMember(RollcallError):
    """The member id is unknown to the current job (never joined, or gone)."""


class NoSuchJob(RollcallError):
    """The service does not serve the job named in the request."""


class NotLeader(RollcallError):
    """This replica does not run roll calls; try the leader (may be named)."""

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class ControlPlaneUnavailable(RollcallError):
    """etcd (or every rendezvous replica) cannot be reached right now; retry."""


class Evicted(StaleEpoch):
    """This member is not in the committed view any more (removed by a roll
    call, or suspected); rejoin to continue."""


class RollCallTimeout(RollcallError):
    """A roll call did not produce a committed view within its bound."""
