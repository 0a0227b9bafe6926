"""Where a worker's state comes from when no live worker holds it: which
checkpoint to resume from, or why the job must not start at step 0, and
what workers started again after etcd lost the job's record will find.

The decision only (``choose``): the runtime restores what is chosen,
reports the replay cost and publishes an adopted file again
(``rollcall.worker.runtime.Elastic._resume_from_checkpoint``). Every
refusal says what to do: restore a copy or etcd from a backup, give the
checkpoint directory, or start over on purpose (``start_over``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rollcall.membership.checkpoint import (
    CheckpointManifest,
    progress_limit,
    started_over_file_name,
)
from rollcall.membership.errors import CannotResume, ConfigurationMismatch, ProgressLost
from rollcall.membership.fingerprint import JobFingerprint, compare, describe_mismatch
from rollcall.protocol.client import Status
from rollcall.worker.checkpoint import (
    Loaded,
    Orphans,
    find_orphans,
    load_newest,
    mark_started_over,
)

__all__ = ["Chosen", "choose", "what_restarting_does"]

log = logging.getLogger("rollcall.worker")

_START_OVER = (
    "start over on purpose with start_over=True (rollcall worker --start-over) or a new job name"
)


@dataclass(frozen=True)
class Chosen:
    """The checkpoint to resume from; ``orphans`` when it is a file etcd no
    longer names (etcd lost the job's record), with the job's other such
    files."""

    loaded: Loaded
    orphans: Orphans | None = None


def choose(
    status: Status,
    *,
    job: str,
    directory: Path | None,
    start_over: bool,
    fingerprint: JobFingerprint,
) -> Chosen | None:
    """What a view that no member holds state for resumes from, given the
    job's ``status``: the newest usable recorded checkpoint; with no record
    at all, the newest written checkpoint file in ``directory`` that
    verifies; None to start at step 0 (a new job, or ``start_over``).

    Raises ``CheckpointUnusable`` when checkpoints exist but none loads, and
    ``ProgressLost`` when the job has progress (recorded, or known lost with
    etcd's data) and nothing holds it."""
    if status.checkpoints:
        # A manifest beyond the job's recorded progress is not trusted (the
        # leader records progress at least up to each checkpoint it accepts).
        known = status.last_step is not None
        limit = progress_limit(status.last_step, status.step) if known else None
        return Chosen(load_newest(status.checkpoints, limit))
    if status.last_step is not None:
        if not start_over:
            raise ProgressLost(
                f"job {job} reached step {status.last_step}, but no live worker holds its "
                "state and it has no durable checkpoint: starting again would silently "
                "retrain it from step 0. To start over on purpose pass start_over=True "
                "(rollcall worker --start-over) or use a new job name; to keep a job's "
                "progress through such losses, give its workers checkpoint_dir= (rollcall "
                "worker --checkpoint-dir)"
            )
        log.warning(
            "job %s had reached step %d and no state is left: starting over from step 0 as "
            "asked (start_over)", job, status.last_step,
        )  # fmt: skip
        _set_aside(job, directory)
        return None
    if directory is not None and not start_over:
        found = _orphaned(job, directory, fingerprint)
        if found is not None:
            return found
    _refuse_lost_history(job, directory, status.lost_epoch, start_over)
    if start_over:
        _set_aside(job, directory)
    return None  # a new job (or starting over): step 0 is where it starts


def _set_aside(job: str, directory: Path | None) -> None:
    """Starting over on purpose: list the job's checkpoint files in
    ``directory`` as the discarded run's (``mark_started_over``), so that
    if etcd loses the new run's record before it wrote a checkpoint, or
    its files are damaged, its workers refuse instead of resuming the run
    that was started over. ``CannotResume`` if they cannot be listed."""
    if directory is None:
        return
    marker = directory / started_over_file_name(job)
    try:
        orphans = find_orphans(directory, job, apart=False)
        if not orphans.manifests:
            return
        mark_started_over(directory, job, orphans.manifests)
    except (OSError, ValueError) as exc:
        raise CannotResume(
            f"job {job} is to start over, but its checkpoint files in {directory} cannot be "
            f"listed as the discarded run's in {marker} ({_why(exc)}): a later loss of etcd's "
            "record would resume that run. Nothing was changed. Make the directory writable, "
            "or move the job's files out of it"
        ) from exc
    log.warning(
        "job %s starts over: its %d checkpoint files in %s (the newest of step %d) are the "
        "discarded run's and are never resumed from; they are listed in %s (delete the files "
        "to free the space)", job, len(orphans.manifests), directory,
        orphans.manifests[0].step, marker,
    )  # fmt: skip


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _orphaned(job: str, directory: Path, fingerprint: JobFingerprint) -> Chosen | None:
    """etcd holds no record of the job (no progress, no manifest): if
    ``directory`` holds the job's checkpoint files, etcd most likely lost
    the job's data, and starting at step 0 would silently discard (and later
    overwrite) them. The newest written file that verifies against the
    manifest copy beside it; None if there is no such file."""
    lost = (
        f"job {job} has no record in etcd (no progress, no checkpoint manifest), but "
        f"{directory} holds checkpoint files of it: etcd probably lost the job's data"
    )
    marker = directory / started_over_file_name(job)
    try:
        orphans = find_orphans(directory, job)
    except OSError as exc:
        raise ProgressLost(
            f"job {job} has no record in etcd and its checkpoint directory {directory} (or "
            f"{marker.name} in it) cannot be read ({_why(exc)}): whether it holds the job's "
            "checkpoints is unknown, so it is not started at step 0. Fix the directory's "
            f"permissions, or {_START_OVER}"
        ) from exc
    except ValueError as exc:
        raise ProgressLost(
            f"job {job} has no record in etcd, and {marker}, which lists its checkpoint files "
            f"of runs started over, is malformed ({exc}): which files are the job's current "
            f"run is unknown. Restore etcd from a backup; delete {marker} to resume from the "
            f"newest file that verifies, whichever run wrote it; or {_START_OVER}"
        ) from exc
    if not orphans.manifests:
        if orphans.started_over and not orphans.unchecked:
            raise ProgressLost(_only_started_over(job, directory, marker, orphans))
        if not orphans.unchecked:
            return None
        raise ProgressLost(
            f"{lost}, and none can be checked ({'; '.join(orphans.unchecked)}). Starting at "
            f"step 0 would silently discard them. Restore etcd from a backup, or {_START_OVER}"
        )
    passed_over = (
        f" ({len(orphans.started_over)} files of a run started over before are not tried: "
        f"delete {marker} to resume that run)"
        if orphans.started_over
        else ""
    )
    recovery = (
        f"nothing was changed{passed_over}. Restore a good copy into {directory} or etcd from "
        f"a backup, or {_START_OVER}"
    )
    found = f"files of job {job} in {directory} (etcd holds no record of the job)"
    loaded = load_newest(orphans.manifests, found=found, recovery=recovery)
    written_by = orphans.fingerprints.get(loaded.manifest.uri)
    differences = compare(fingerprint, written_by) if written_by is not None else ()
    if differences:
        # etcd's record, which refuses such a worker at join, is gone: the
        # copy beside the file stands in for it.
        raise ConfigurationMismatch(
            f"{Path(loaded.manifest.uri).name} was written by job {job} with other settings "
            "(etcd lost the job's record, so the checkpoint's copy of them is what this "
            "worker is checked against): " + describe_mismatch(job, differences)
        )
    return Chosen(loaded, orphans)


def _only_started_over(job: str, directory: Path, marker: Path, orphans: Orphans) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(orphans.started_over_at or 0))
    return (
        f"job {job} has no record in etcd (no progress, no checkpoint manifest), and the "
        f"{len(orphans.started_over)} checkpoint files of it in {directory} are all of a run "
        f"that was started over (--start-over, at {when}; listed in {marker.name}). The run "
        "since wrote none: etcd probably lost the job's data again before its first "
        "checkpoint, and its progress is lost. Starting at step 0 would silently discard it, "
        "and resuming the older run would train the model that was discarded. Restore etcd "
        f"from a backup, or {_START_OVER}; to resume the older run instead (its newest file is "
        f"of step {orphans.started_over[0].step}), delete {marker}"
    )


def _refuse_lost_history(
    job: str, directory: Path | None, lost_epoch: int, start_over: bool
) -> None:
    """No record and no checkpoint file, but etcd is known to have lost the
    job's data (``lost_epoch``, set by the rendezvous service when it
    refused a member of that epoch): ``ProgressLost`` unless ``start_over``."""
    if not lost_epoch:
        return
    if start_over:
        log.warning(
            "job %s had trained (a worker was at epoch %d when etcd lost the job's data): "
            "starting over from step 0 as asked (start_over)", job, lost_epoch,
        )  # fmt: skip
        return
    where = (
        f"no checkpoint file of it is in {directory}"
        if directory is not None
        else "this worker has no checkpoint directory"
    )
    raise ProgressLost(
        f"job {job} has no record in etcd, but etcd lost its data while it trained (a worker "
        f"was at epoch {lost_epoch}) and {where}: starting it at step 0 would silently "
        "discard what it trained. Restore etcd from a backup, start the workers with the "
        "checkpoint directory that holds the job's files (--checkpoint-dir), or start over "
        "on purpose: start_over=True (rollcall worker --start-over) or a new job name"
    )


def what_restarting_does(
    held: int, directory: Path | None, saved: CheckpointManifest | str | None
) -> str:
    """What workers started again after etcd lost the job's record find
    (``JobRecordLost``), for a worker that held step ``held`` and wrote it
    on its way out (``saved``: the manifest, why it could not, or None):
    said, so that nobody restarts from step 0 unawares."""
    holding = f"This worker held step {held}"
    if directory is None:
        return (
            f"{holding} and has no checkpoint directory: workers started again find no record "
            "of the job and, without checkpoint files, refuse to start it at step 0 unless "
            "told to (--start-over). Restore etcd from a backup to keep the progress"
        )
    if isinstance(saved, CheckpointManifest):
        return (
            f"{holding} and wrote it to {saved.uri} before exiting: workers started again "
            "resume from it"
        )
    unsaved = f" (writing it before exiting failed: {saved})" if saved else ""
    return (
        f"{holding}{unsaved}; workers started again resume from the newest checkpoint file in "
        f"{directory} that verifies"
    )
