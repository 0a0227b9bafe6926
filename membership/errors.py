"""Named errors of the control plane. Each tells the caller what to do."""

from __future__ import annotations


class RollcallError(Exception):
    """Base of every error rollcall raises on purpose."""


class InvalidRequest(RollcallError):
    """The request is malformed (bad id, address, size, field); fix the caller."""


class Unauthenticated(RollcallError):
    """The job token is missing or wrong."""


class PermissionDenied(RollcallError):
    """The request names a member (or acts in a view) without that member's
    secret (or the view's epoch secret): it does not come from that member,
    and nothing changed. A genuine member sees it only if its credentials
    were lost (rejoin)."""


class StoreTampered(RollcallError, RuntimeError):
    """A value in a view's bootstrap store does not carry the view's epoch
    secret (written by someone without it, or moved from another key or
    view): the group's build fails as if a peer were absent, and a roll call
    follows. A ``RuntimeError`` so that it crosses torch's store interface."""


class StaleEpoch(RollcallError):
    """The request belongs to an epoch the sender is no longer part of:
    the sender must rejoin before it may act again."""


class NotAMember(RollcallError):
    """The member id is unknown to the current job (never joined, or gone)."""


class NoSuchJob(RollcallError):
    """The service does not serve the job named in the request."""


class NoSuchCheckpoint(RollcallError):
    """No manifest of that step is in the job's checkpoint record (`rollcall
    checkpoints list` shows the recorded ones)."""


class NotLeader(RollcallError):
    """This replica does not run roll calls; try the leader (may be named)."""

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class ControlPlaneUnavailable(RollcallError):
    """etcd (or every rendezvous replica) cannot be reached right now; retry."""


class EtcdCredentialsRefused(ControlPlaneUnavailable):
    """etcd refused who we are: a wrong user or password, no credentials
    where etcd requires them, or a user not permitted to read and write
    ``/rollcall/``. A replica fails to start with it; once running it keeps
    retrying (the job's workers keep training) and says so. Fix the
    credentials (``--etcd-user``, ``--etcd-password-file``)."""


class MalformedRecord(ControlPlaneUnavailable):
    """A value read from etcd is not one rollcall writes (planted, forged or
    corrupted). The message names the key and what is wrong with it. Where
    the value can be done without it is logged and ignored; a replica that
    would need it (the job's view) refuses to act on it until it is
    repaired."""


class Evicted(StaleEpoch):
    """This member is not in the committed view any more (removed by a roll
    call, or suspected); rejoin to continue."""


class JobRecordLost(RollcallError):
    """The control plane has no record of the view this member is in: etcd
    lost the job's data (wiped, replaced, restored from an old backup) and
    no rendezvous replica remembered it. The member's state is intact but it
    cannot rejoin under its old id: restart the job's workers; with a
    checkpoint directory they resume from the newest checkpoint file in it."""


class NotProposed(RollcallError):
    """A view reported committed that the coordinator did not hand out for
    commit (or no longer waits for): the caller's bookkeeping is wrong, and
    the coordinator's state is left as it was."""


class UsageError(RollcallError):
    """The training loop uses the runtime in a way that would give a wrong
    result without any other error (a scheduler stepped twice, gradients
    changed before they were reduced...). The message says what to change."""


class ViewChanged(RollcallError):
    """A collective of the user's own (``Elastic.all_reduce``) was abandoned
    because the membership changed or a peer failed: nothing was reduced.
    The step in flight is aborted too; carry on with the next step."""


class NonFiniteGradient(RollcallError):
    """A step's reduced gradient holds NaN or infinity, in a job without a
    grad scaler; or, with or without one, the gradient ``before_update``
    left of a finite one does. Applied, it would make every replica's
    weights NaN for the rest of the run, and every checkpoint after it.
    Every rank raises it at that step's commit, before the optimizer steps,
    so the model's parameters, its replicas and the checkpoints keep the
    step before. Also raised when a grad scaler has skipped
    ``max_skipped_steps`` steps in a row (the run trains no more), and when
    the optimizer's update of a finite gradient leaves parameters that are
    not (then the checkpoints, not the model, keep the step before)."""


class StateDrifted(RollcallError):
    """This worker's copy of a partition of the sharded optimizer state is
    not bit for bit the copy another owner computed and the job's model
    follows: the workers do not compute alike. Kept, it would change the
    job's course the moment that owner is lost, so the worker stops
    instead; started again, it rejoins and takes the others' copies."""


class CannotResume(RollcallError):
    """No live worker holds the job's state and it cannot be restored, so
    the worker stops instead of starting the job from scratch on its own."""


class ProgressLost(CannotResume):
    """The job has progress (its last committed step is recorded) but no
    live replica and no durable checkpoint hold it. Starting over is an
    explicit decision (``start_over=True``, ``rollcall worker --start-over``
    or a new job name), never a silent one."""


class Interrupted(SystemExit):
    """The worker received SIGINT or SIGTERM and left the job cleanly (the
    others reconfigure at once). A ``SystemExit`` with the conventional code
    128 + signal, so an uncaught one exits quietly; catch it to save
    something first."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigurationMismatch(RollcallError):
    """This worker's configuration differs from its job's (global batch,
    seed, model, optimizer...; ``rollcall.membership.fingerprint``): it may not train
    with the others. Fix its settings, or start a new job under another name."""


class UnsafeTiming(ConfigurationMismatch):
    """This worker's timing settings do not fit the rendezvous service's,
    which the service sends at join: kept, they could let an evicted worker
    apply a step or get a live one evicted. The worker leaves again at once;
    the message names both values and what to change."""


class UnsafeStepEndWait(UnsafeTiming):
    """This worker's ``rollcall_step_end_wait`` exceeds the rendezvous
    service's: at a join or a clean leave it would wait for its step to end
    after the service stopped waiting for its answer, and be evicted."""

    def __init__(self, wait: float, service_wait: float) -> None:
        super().__init__(
            f"this worker waits up to {wait:g} s for its step to end before it answers a "
            f"roll call held for a join or a clean leave (rollcall_step_end_wait={wait:g}), "
            f"but the rendezvous service waits only {service_wait:g} s for that: it would "
            "answer too late and be evicted at the first join. Give the replicas "
            "(rollcall rendezvous) and the workers the same --set "
            "rollcall_step_end_wait=SECONDS"
        )
        self.wait = wait
        self.service_wait = service_wait


class UnsafeFencePatience(UnsafeTiming):
    """This worker's ``fence_patience`` does not cover a failover of the
    rendezvous service's leader (its ``election_ttl`` and this worker's
    ``session_open_timeout``): it would drop steps that other members land."""

    def __init__(self, patience: float, election_ttl: float, open_timeout: float) -> None:
        super().__init__(
            f"this worker waits at most {patience:g} s at its fence for a heartbeat "
            f"acknowledgement (fence_patience), but a failover of the rendezvous service's "
            f"leader holds them back up to {election_ttl + open_timeout:g} s (its election_ttl "
            f"{election_ttl:g} s and this worker's session_open_timeout {open_timeout:g} s): "
            "it would drop steps that other members land. Raise this worker's --set "
            "fence_patience=SECONDS, or give the replicas and the workers the same "
            "election_ttl"
        )
        self.patience = patience
        self.election_ttl = election_ttl


class UnsafeFenceWindow(UnsafeTiming):
    """This worker's ``fence_window`` is not below the rendezvous service's
    earliest suspicion of a silent member: it could apply a step after being
    evicted. Lower the fence or match the service's detector settings."""

    def __init__(self, fence_window: float, earliest_suspicion: float) -> None:
        super().__init__(
            f"this worker's fence_window is {fence_window:g} s but the rendezvous service "
            f"may suspect a silent member {earliest_suspicion:.4g} s after its last heartbeat: "
            "the fence must be shorter, or an evicted worker could still apply a step; lower "
            "this worker's fence_window (--set fence_window=...) or match the service's "
            "detector settings (heartbeat_interval, phi_threshold, phi_min_std, max_silence)"
        )
        self.fence_window = fence_window
        self.earliest_suspicion = earliest_suspicion
