"""Durable checkpoints on disk: written in the background, published only
when complete, checked before anything trusts them, loaded (newest usable
first) when no live replica is left.

A checkpoint file holds ``rollcall.worker.state_bytes.to_bytes`` of a
committed step, under a name that carries the job, the step and the writer
(``rollcall.membership.checkpoint.file_name``). The writer creates it (mode 0600, in
a directory it creates 0700) under a temporary name, syncs it, renames it
into place and syncs the directory; only then does it publish the manifest
(size, SHA-256 of the bytes, state digest) through the rendezvous service,
which records it in etcd.

Nothing read back is trusted unchecked. A reader checks size, SHA-256, that
the bytes load as a replica state, the state digest, and the step. A writer
deletes only files it wrote, or that its job's manifests named and it
verified, and only once a newer checkpoint it verified is recorded: a
manifest it cannot verify (forged, torn, on storage it cannot read) never
makes it delete anything, and the newest complete checkpoint is never
deleted. A failure to write or publish never ends the writer: it is counted,
reported (``on_failure``) and tried again at the next due step.

The directory must be one the whole job can read (shared storage) for a new
set of workers on other hosts to resume from it; a manifest whose file is
not readable is skipped like a corrupt one, with the reason logged.

A sharded job's checkpoint is several files: every rank that sends
partitions in the job's parameter all-gather writes their optimizer state
to a part file (``submit_part``), and rank 0 writes the rest of the state
with a manifest listing every part, which it publishes only once every
part is there (``submit`` with ``parts``): so the directory must be shared
by the job's workers for a sharded job to write checkpoints at all. A
reader checks every part as it checks the file, and puts the optimizer
state back together in the optimizer's own ``state_dict`` form
(``rollcall.worker.sharded.assemble_state``), which loads at any world
size.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

import psutil

from rollcall.membership.checkpoint import (
    MANIFEST_SUFFIX,
    MAX_REASON_LENGTH,
    CheckpointManifest,
    CheckpointPart,
    file_name,
    is_job_file,
    manifest_file_name,
    parse_file_name,
    parse_part_name,
    part_file_name,
    started_over_file_name,
    superseded,
)
from rollcall.membership.errors import CannotResume, InvalidRequest
from rollcall.membership.fingerprint import JobFingerprint
from rollcall.worker.digest import digest, hash_threads, tree_digest
from rollcall.worker.sharded import LAYOUT_KEY, PartitionState, ShardLayout, assemble_state
from rollcall.worker.state import CorruptState, ReplicaState
from rollcall.worker.state_bytes import from_bytes, to_bytes, tree_from_bytes, tree_to_bytes

__all__ = [
    "CheckpointUnusable",
    "CheckpointWriter",
    "Loaded",
    "Orphans",
    "describe_failure",
    "file_problem",
    "find_orphans",
    "load_newest",
    "process_age",
    "state_problem",
]

log = logging.getLogger("rollcall.checkpoint")
#: How often a sharded checkpoint looks for the other ranks' parts.
PART_POLL = 0.05

#: Publishes a complete checkpoint; returns (accepted, manifests kept).
Publish = Callable[[CheckpointManifest], tuple[bool, Sequence[CheckpointManifest]]]
#: Told that the checkpoint of a step failed, and why (one line).
OnFailure = Callable[[int, str], None]
#: Told the step of a checkpoint that is now recorded.
OnDurable = Callable[[int], None]

#: The key of the job's fingerprint in a manifest copy.
FINGERPRINT_KEY = "job_fingerprint"

#: What an operator does when no checkpoint loads (CheckpointUnusable).
RECOVERY = (
    "nothing was changed. `rollcall checkpoints verify` shows each one's problem; "
    "restore a damaged file from a copy, or remove the unusable manifests from the job's "
    "record with `rollcall checkpoints forget STEP` (`--all` for every one; the files "
    "stay unless --delete-files), after which the workers resume from an older usable "
    "checkpoint, or, with none left, start over only when asked to (--start-over, "
    "start_over=True)"
)


class CheckpointUnusable(CannotResume):
    """No published checkpoint could be loaded (all missing, unreadable or
    corrupt). Nothing was changed: the files and the manifests stay as they
    are, and the worker does not start from scratch on its own."""


@dataclass(frozen=True)
class Loaded:
    state: ReplicaState
    manifest: CheckpointManifest
    seconds: float
    #: Newer manifests passed over, each with the reason.
    skipped: tuple[str, ...]


def file_problem(
    manifest: CheckpointManifest | CheckpointPart, blob: bytes | None = None
) -> str | None:
    """What is wrong with the file ``manifest`` (or a part) names
    (unreadable, another size, another SHA-256), or None if it is the file
    that was published. ``blob``: its bytes, if already read. A manifest's
    parts are not looked at (``parts_problem``)."""
    if blob is None:
        try:
            blob = Path(manifest.uri).read_bytes()
        except OSError as exc:
            return f"unreadable ({exc.strerror or exc})"
    if len(blob) != manifest.size:
        return f"{len(blob)} bytes, manifest says {manifest.size} (torn or replaced)"
    if hashlib.sha256(blob).hexdigest() != manifest.sha256:
        return "SHA-256 differs from the manifest (corrupt)"
    return None


def part_bytes(partitions: Sequence[PartitionState]) -> bytes:
    """The content of a part file: each partition's number and its state,
    decoded without running code (``tree_from_bytes``)."""
    return tree_to_bytes([[part.partition, list(part.segments)] for part in partitions])


def describe_part(uri: str, blob: bytes, partitions: Sequence[PartitionState]) -> CheckpointPart:
    """The manifest's entry for a part file of ``blob`` at ``uri``."""
    return CheckpointPart(
        uri=uri, size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
        partitions=tuple(part.partition for part in partitions),
        digests=tuple(tree_digest(list(part.segments)) for part in partitions),
    )  # fmt: skip


def _part_states(part: CheckpointPart) -> tuple[list[PartitionState] | None, str | None]:
    """A part's partitions, checked as a resuming worker checks them (the
    file's size and SHA-256, then each partition's number and digest)."""
    try:
        blob = Path(part.uri).read_bytes()
    except OSError as exc:
        return None, f"part {part.uri} unreadable ({exc.strerror or exc})"
    problem = file_problem(part, blob)
    if problem is not None:
        return None, f"part {part.uri}: {problem}"
    try:
        entries = tree_from_bytes(blob)
        found = [PartitionState(int(p), tuple(segments)) for p, segments in entries]
    except (CorruptState, TypeError, ValueError) as exc:
        return None, f"part {part.uri} does not decode ({exc})"
    if tuple(state.partition for state in found) != part.partitions:
        return None, f"part {part.uri} holds other partitions than its manifest says"
    for state, want in zip(found, part.digests, strict=True):
        if tree_digest(list(state.segments)) != want:
            return None, f"partition {state.partition} in {part.uri} fails its digest"
    return found, None


def parts_problem(manifest: CheckpointManifest) -> str | None:
    """The first part of ``manifest`` that is not the file published (None:
    every one is, or it has none)."""
    for part in manifest.parts:
        problem = file_problem(part)
        if problem is not None:
            return f"part {part.uri}: {problem}"
    return None


def state_problem(manifest: CheckpointManifest) -> tuple[ReplicaState | None, str | None]:
    """Every check a resuming worker makes: the file's (``file_problem``),
    then that it loads as a replica state with the recorded digest and step.
    Returns (the state, None) or (None, the problem)."""
    try:
        blob = Path(manifest.uri).read_bytes()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    problem = file_problem(manifest, blob)
    if problem is not None:
        return None, problem
    try:
        # A resuming worker (or an operator's check) waits for this: every
        # core hashes.
        state = from_bytes(blob, expect_digest=manifest.digest, threads=hash_threads())
    except CorruptState as exc:
        return None, str(exc)
    if state.step != manifest.step:
        return None, f"holds step {state.step}, manifest says {manifest.step}"
    layout = state.optimizer.get(LAYOUT_KEY) if isinstance(state.optimizer, dict) else None
    if (layout is None) != (not manifest.parts):
        return None, "its optimizer state and its manifest's parts do not go together"
    if layout is not None:
        partitions: list[PartitionState] = []
        for part in manifest.parts:
            found, problem = _part_states(part)
            if found is None:
                return None, problem
            partitions.extend(found)
        try:
            state.optimizer = assemble_state(
                ShardLayout.from_tree(layout), partitions, state.optimizer["param_groups"]
            )
        except (KeyError, ValueError) as exc:
            return None, f"its parts do not make up the optimizer state ({exc})"
    return state, None


def load_newest(
    manifests: Sequence[CheckpointManifest],
    limit: int | None = None,
    *,
    found: str = "published",
    recovery: str = RECOVERY,
) -> Loaded:
    """Load the newest checkpoint that passes every check; older ones are
    tried when a newer one is missing or corrupt, or beyond ``limit`` (the
    highest step the job's recorded progress allows,
    ``rollcall.membership.checkpoint.progress_limit``; None: no progress is known and
    none is checked). Raises :class:`CheckpointUnusable` naming each one's
    problem if none does, where the manifests were ``found`` and what an
    operator can do (``recovery``)."""
    started = time.perf_counter()
    skipped: list[str] = []
    for manifest in manifests:
        state: ReplicaState | None = None
        problem: str | None = f"beyond the job's recorded progress (step {(limit or 0) - 1})"
        if limit is None or manifest.step <= limit:
            state, problem = state_problem(manifest)
        if state is not None:
            return Loaded(state, manifest, time.perf_counter() - started, tuple(skipped))
        reason = f"checkpoint of step {manifest.step} at {manifest.uri}: {problem}"
        log.warning("skipping %s", reason)
        skipped.append(reason)
    raise CheckpointUnusable(
        f"no usable checkpoint among the {len(manifests)} {found}: {'; '.join(skipped)}; "
        + recovery
    )


@dataclass(frozen=True)
class Orphans:
    """A job's checkpoint files in a directory, read when etcd's record of
    the job names none (etcd lost the job's data): each file's manifest is
    the copy written beside it."""

    #: Manifests of the files that can be checked, newest written first
    #: (not highest step first: files of an earlier run under the same job
    #: name, started over on purpose, may hold higher steps).
    manifests: tuple[CheckpointManifest, ...]
    #: Files that cannot be checked, each with the reason.
    unchecked: tuple[str, ...]
    #: The fingerprint of the job that wrote each file, by location (None:
    #: its copy holds none).
    fingerprints: Mapping[str, JobFingerprint | None] = field(default_factory=dict)
    #: Files of runs started over on purpose (listed in the directory's
    #: ``started_over_file_name``), newest written first: never resumed from.
    started_over: tuple[CheckpointManifest, ...] = ()
    #: When the job was last started over in this directory (Unix time).
    started_over_at: float | None = None


def _read_started_over(directory: Path, job: str) -> tuple[dict[str, float], float | None]:
    """The files ``started_over_file_name`` lists, each with the time its
    manifest copy says it was written, and when it was last written; empty
    without the file. Raises OSError if it cannot be read and ValueError if
    it is malformed."""
    try:
        text = (directory / started_over_file_name(job)).read_bytes()
    except FileNotFoundError:
        return {}, None
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    files, at = record.get("files"), record.get("at")
    if record.get("job") != job or not isinstance(files, dict) or not _is_time(at):
        raise ValueError("not a list of this job's started-over files")
    if not all(isinstance(n, str) and _is_time(t) for n, t in files.items()):
        raise ValueError("a file's entry is not a name and a time")
    return {name: float(t) for name, t in files.items()}, float(at)


def _is_time(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _newest_written(manifest: CheckpointManifest) -> tuple[float, int]:
    return (manifest.created_unix, manifest.step)


def mark_started_over(directory: Path, job: str, manifests: Sequence[CheckpointManifest]) -> Path:
    """List the files of ``manifests`` (``job``'s checkpoint files found in
    ``directory``) as a run's that is being started over on purpose, beside
    any listed before: :func:`find_orphans` never offers them again, so a
    later loss of etcd's record does not resume the discarded run. Each
    file is named with the time its copy says it was written (a file of
    the new run written under the same name is not listed). Raises OSError
    if the list cannot be written."""
    path = directory / started_over_file_name(job)
    try:
        files, _ = _read_started_over(directory, job)
    except ValueError:  # a malformed list is replaced: the files are listed anew
        files = {}
    files.update({Path(m.uri).name: float(m.created_unix) for m in manifests})
    record = {"job": job, "at": time.time(), "files": dict(sorted(files.items()))}
    _write_atomically(path, json.dumps(record, indent=1).encode())
    _fsync_directory(directory)
    return path


def find_orphans(directory: Path, job: str, *, apart: bool = True) -> Orphans:
    """``job``'s checkpoint files in ``directory`` and the manifest copies
    beside them. A file counts only if it is a regular file owned by this
    user and its copy loads and claims the step the file is named for;
    files of a run started over (:func:`mark_started_over`) are kept apart
    unless not ``apart``. Raises OSError if the directory or the list of
    started-over files cannot be read, and ValueError if that list is
    malformed."""
    marked, marked_at = _read_started_over(directory, job) if apart else ({}, None)
    manifests: list[CheckpointManifest] = []
    started_over: list[CheckpointManifest] = []
    unchecked: list[str] = []
    fingerprints: dict[str, JobFingerprint | None] = {}
    for path in sorted(directory.iterdir()):
        step = parse_file_name(path.name, job)
        if step is None:
            continue
        problem: str | None = None
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode):
                problem = "not a regular file"
            elif info.st_uid != os.getuid():
                problem = f"owned by uid {info.st_uid}, not by this user"
            else:
                copy = json.loads(path.with_name(manifest_file_name(path.name)).read_bytes())
                manifest = CheckpointManifest.from_dict(copy)
                written_by = copy.get(FINGERPRINT_KEY)
                fingerprint = None if written_by is None else JobFingerprint.of(written_by)
                if manifest.step != step:
                    problem = f"its manifest copy claims step {manifest.step}"
        except FileNotFoundError:
            problem = "no manifest copy beside it, nothing to check it against"
        except OSError as exc:
            problem = f"unreadable ({exc.strerror or exc})"
        except (ValueError, InvalidRequest) as exc:
            problem = f"its manifest copy is malformed ({exc})"
        if problem is not None:
            unchecked.append(f"{path.name}: {problem}")
        elif marked.get(path.name) == float(manifest.created_unix):
            started_over.append(replace(manifest, uri=str(path)))
        else:
            manifests.append(replace(manifest, uri=str(path)))
            fingerprints[str(path)] = fingerprint
    manifests.sort(key=_newest_written, reverse=True)
    started_over.sort(key=_newest_written, reverse=True)
    return Orphans(
        tuple(manifests), tuple(unchecked), fingerprints, tuple(started_over), marked_at
    )


#: A temporary of one of the job's checkpoint files untouched this long is
#: a killed writer's, not a write in progress (``remove_leftovers``).
LEFTOVER_AGE = 3600.0
#: ``.<name>.<pid>.<8 hex>.tmp``: ``_write_atomically``'s temporary for ``name``.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.\d+\.[0-9a-f]{8}\.tmp")


def remove_leftovers(directory: Path, job: str, older_than: float = LEFTOVER_AGE) -> None:
    """Delete what killed writers left of ``job``'s checkpoints in
    ``directory``: temporaries (a write that never reached its rename; as
    large as a checkpoint) and manifest copies whose file is gone (a kill
    between the two deletions), each untouched for ``older_than`` seconds,
    a regular file, owned by this user. Nothing names them and nothing else
    deletes them; files named in no record are kept (a worker adopts them
    if etcd loses the job's record). Logged; an error only warned of."""

    def ours(name: str) -> bool:
        return is_job_file(name.removesuffix(MANIFEST_SUFFIX), job)

    removed = size = 0
    try:
        names = os.listdir(directory)
    except OSError as exc:
        log.warning("could not look for leftover checkpoint files in %s: %s", directory, exc)
        return
    for name in names:
        temporary = _TEMPORARY.fullmatch(name)
        if temporary is not None:
            if not ours(temporary.group("name")):
                continue
        elif not name.endswith(MANIFEST_SUFFIX) or not ours(name):
            continue
        elif (directory / name[: -len(MANIFEST_SUFFIX)]).exists():
            continue  # a copy beside its file
        path = directory / name
        try:
            info = os.lstat(path)
            if (
                stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
                and time.time() - info.st_mtime >= older_than
            ):  # fmt: skip
                path.unlink()
                removed, size = removed + 1, size + info.st_size
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete the leftover checkpoint file %s: %s", path, exc)
    if removed:
        log.info("removed %d files of job %s left by killed writers (%d bytes) in %s",
                 removed, job, size, directory)  # fmt: skip


def process_age() -> float:
    """Seconds since this process started."""
    return max(0.0, time.time() - psutil.Process().create_time())


def describe_failure(exc: BaseException) -> str:
    """One line for a failed checkpoint: the system's words and errno name
    for an OSError ("No space left on device (ENOSPC): /path"), else the
    error's message."""
    if isinstance(exc, OSError) and exc.strerror:
        name = errno.errorcode.get(exc.errno or 0)
        where = f": {exc.filename}" if exc.filename else ""
        text = f"{exc.strerror}{f' ({name})' if name else ''}{where}"
    else:
        text = str(exc) or type(exc).__name__
    return text[:MAX_REASON_LENGTH]


@dataclass(frozen=True)
class _Owned:
    """A file this writer may prune: its step, and what it was when checked."""

    step: int
    size: int
    inode: int


class _Unpublished(Exception):
    """The file is written, but publishing its manifest failed."""


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread.

    ``submit`` returns at once; while a write is in flight further submits
    are skipped (the next due step will be written instead), so a slow disk
    never stalls training.
    """

    def __init__(
        self,
        directory: Path,
        job: str,
        publish: Publish,
        on_failure: OnFailure | None = None,
        on_durable: OnDurable | None = None,
        fingerprint: JobFingerprint | None = None,
        part_wait: float = 30.0,
    ) -> None:
        # 0700 when created here; the parents rollcall creates get the umask.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory.resolve()
        self.job = job
        remove_leftovers(self.directory, job)
        self._publish = publish
        self._on_failure = on_failure
        self._on_durable = on_durable
        #: The job's fingerprint, kept in each manifest copy: a file etcd no
        #: longer names is resumed from only by a job of the same settings.
        self._fingerprint = fingerprint
        #: How long a sharded checkpoint waits for the other ranks' parts
        #: to appear before it gives up (and is not published).
        self._part_wait = part_wait
        self._thread: threading.Thread | None = None
        #: Files this writer may delete once superseded, by location.
        self._owned: dict[str, _Owned] = {}
        #: Verification results by (location, size, sha256, file identity).
        self._checked: dict[tuple[str, int, str], tuple[tuple[int, int, int], str | None]] = {}
        self._warned: set[tuple[str, str]] = set()
        self.written = 0
        self.skipped = 0
        #: Failed attempts in all, and since the last recorded checkpoint.
        self.failed = 0
        self.failing = 0
        #: Unix time of the first failure since the last recorded checkpoint.
        self.failing_since: float | None = None
        self.last_error: str | None = None
        #: Step of the newest checkpoint this writer saw recorded and verified.
        self.durable_step: int | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ready(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` can start now; if not (the
        previous one is still being written), it is skipped and counted."""
        if not self.busy:
            return True
        self.skip(step, "the previous one is still being written")
        return False

    def skip(self, step: int, why: str) -> None:
        """Count the checkpoint of ``step`` as skipped, saying ``why``."""
        self.skipped += 1
        log.info("checkpoint of step %d skipped: %s", step, why)

    def part_path(self, step: int, writer: str) -> Path:
        """Where ``writer`` writes its part of the checkpoint of ``step``."""
        return self.directory / part_file_name(self.job, step, writer)

    def submit(
        self, state: ReplicaState, epoch: int, writer: str, step_seconds: float,
        parts: Sequence[CheckpointPart] = (), own_part: bytes | None = None,
    ) -> bool:  # fmt: skip
        """Write ``state`` (a capture the caller no longer touches) and
        publish it. In a sharded job, ``parts`` lists every part of it, and
        ``own_part`` is this writer's (written here, at ``part_path``); the
        manifest is published once every other part is there. False if a
        previous write is still in flight."""
        if not self.ready(state.step):
            return False
        self._thread = threading.Thread(
            target=self._write,
            args=(state, epoch, writer, step_seconds, tuple(parts), own_part),
            name=f"rollcall-checkpoint-{state.step}",
            daemon=True,
        )
        self._thread.start()
        return True

    def submit_part(self, step: int, writer: str, blob: bytes) -> bool:
        """Write this writer's part of a sharded checkpoint of ``step``
        (another rank publishes it). False if a write is still in flight."""
        if not self.ready(step):
            return False
        self._thread = threading.Thread(
            target=self._write_part, args=(step, writer, blob),
            name=f"rollcall-checkpoint-part-{step}", daemon=True,
        )  # fmt: skip
        self._thread.start()
        return True

    def wait(self, timeout: float) -> bool:
        """Wait for the write in flight; False if it is still running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    # --- the writer thread ---------------------------------------------------------

    def _write(
        self, state: ReplicaState, epoch: int, writer: str, step_seconds: float,
        parts: tuple[CheckpointPart, ...] = (), own_part: bytes | None = None,
    ) -> None:  # fmt: skip
        """The thread's body: nothing it meets ends it unreported."""
        started = time.perf_counter()
        try:
            if own_part is not None:
                self._write_part_file(state.step, writer, own_part)
            manifest = self._write_file(state, epoch, writer, step_seconds, parts)
            try:
                accepted, kept = self._publish(manifest)
            except Exception as exc:
                raise _Unpublished(f"written but not published: {exc}") from exc
        except Exception as exc:  # reported, never lost: the next due step tries again
            self._failed(state.step, describe_failure(exc))
            return
        self.written += 1
        seconds = time.perf_counter() - started
        if accepted:
            log.info("checkpoint of step %d: %d bytes in %.3f s, published",
                     state.step, manifest.size, seconds)  # fmt: skip
        try:
            self._settle(manifest, accepted, kept)
        except Exception:  # a bug here must not end the writer either
            log.exception("checkpoint of step %d: checking the record failed", state.step)

    def _write_part(self, step: int, writer: str, blob: bytes) -> None:
        """The thread's body for a part: nothing it meets ends it unreported."""
        try:
            self._write_part_file(step, writer, blob)
        except Exception as exc:  # reported, never lost: the next due step tries again
            self._failed(step, f"part not written: {describe_failure(exc)}")

    def _write_part_file(self, step: int, writer: str, blob: bytes) -> None:
        path = self.part_path(step, writer)
        _write_atomically(path, blob)
        _fsync_directory(self.directory)
        self._owned[str(path)] = _Owned(step, len(blob), os.lstat(path).st_ino)

    def _await_parts(self, manifest: CheckpointManifest) -> None:
        """Wait until every part of ``manifest`` is there with its size
        (each is renamed into place only once written and synced, so one
        that is there is complete); OSError naming the first one missing
        after ``part_wait``. The parts become this writer's to prune with
        the checkpoint."""
        deadline = time.monotonic() + self._part_wait
        for part in manifest.parts:
            while True:
                with contextlib.suppress(FileNotFoundError):
                    info = os.lstat(part.uri)
                    if stat.S_ISREG(info.st_mode) and info.st_size == part.size:
                        self._owned.setdefault(
                            part.uri, _Owned(manifest.step, part.size, info.st_ino)
                        )
                        break
                if time.monotonic() > deadline:
                    raise OSError(
                        errno.ETIMEDOUT,
                        f"part {Path(part.uri).name} was not written within "
                        f"{self._part_wait:g} s: a sharded job's checkpoint directory must be "
                        "storage every worker writes and reads (shared), and every worker "
                        "must be able to write it",
                        part.uri,
                    )
                time.sleep(PART_POLL)

    def _write_file(
        self, state: ReplicaState, epoch: int, writer: str, step_seconds: float,
        parts: tuple[CheckpointPart, ...] = (),
    ) -> CheckpointManifest:  # fmt: skip
        """Write the file and the copy of its manifest beside it (each 0600,
        under a temporary name, synced, renamed; then the directory synced);
        returns the manifest. The copy is written only once every part is
        there (``_await_parts``): if one is not, the attempt's files are
        deleted and the error raised, so no copy ever names a part that
        never landed."""
        path = self.directory / file_name(self.job, state.step, writer)
        blob = to_bytes(state)
        _write_atomically(path, blob)
        uri = str(path)
        self._owned[uri] = _Owned(state.step, len(blob), os.lstat(path).st_ino)
        sha256 = hashlib.sha256(blob).hexdigest()
        self._checked[(uri, len(blob), sha256)] = (_identity(os.lstat(path)), None)
        manifest = CheckpointManifest(
            step=state.step, digest=digest(state), uri=uri, size=len(blob), sha256=sha256,
            epoch=epoch, writer=writer, created_unix=time.time(), step_seconds=step_seconds,
            parts=parts,
        )  # fmt: skip
        try:
            self._await_parts(manifest)
        except OSError:
            self._discard(manifest)
            raise
        record: dict[str, Any] = manifest.to_dict()
        if self._fingerprint is not None:
            record[FINGERPRINT_KEY] = self._fingerprint.as_dict()
        copy = json.dumps(record, sort_keys=True).encode()
        _write_atomically(path.with_name(manifest_file_name(path.name)), copy)
        _fsync_directory(self.directory)
        return manifest

    def write_last(
        self, state: ReplicaState, epoch: int, writer: str, step_seconds: float, timeout: float
    ) -> CheckpointManifest:
        """(In the caller's thread, when the job's record is lost and nothing
        can be published.) Write ``state`` and the copy of its manifest, so
        that workers started again resume from it (``find_orphans``); waits
        up to ``timeout`` for a write in flight first. Raises what writing
        raises."""
        if not self.wait(timeout):
            raise TimeoutError(f"the checkpoint in flight did not finish within {timeout:g} s")
        return self._write_file(state, epoch, writer, step_seconds)

    def adopt(self, manifest: CheckpointManifest, orphans: Sequence[CheckpointManifest]) -> None:
        """(Once, after a resume from files etcd no longer knew of.) Publish
        the adopted checkpoint's ``manifest`` in the background, so that the
        job's new record holds it, and let this writer prune the ``orphans``
        (the other such files of this job it checked) once superseded."""
        for orphan in orphans:
            with contextlib.suppress(OSError):
                info = os.lstat(orphan.uri)
                if stat.S_ISREG(info.st_mode) and info.st_size == orphan.size:
                    owned = _Owned(orphan.step, orphan.size, info.st_ino)
                    self._owned.setdefault(orphan.uri, owned)
        if self.busy:
            return  # a write in flight publishes a newer checkpoint anyway
        self._thread = threading.Thread(
            target=self._publish_adopted, args=(manifest,), name="rollcall-checkpoint-adopt",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _publish_adopted(self, manifest: CheckpointManifest) -> None:
        try:
            accepted, kept = self._publish(manifest)
        except Exception as exc:  # reported, never lost: the next due step publishes anew
            self._failed(manifest.step, f"adopted but not published: {describe_failure(exc)}")
            return
        if accepted:
            log.info("checkpoint of step %d (adopted from %s) published", manifest.step,
                     manifest.uri)  # fmt: skip
        try:
            self._settle(manifest, accepted, kept)
        except Exception:
            log.exception("checkpoint of step %d: checking the record failed", manifest.step)

    def _failed(self, step: int, reason: str) -> None:
        self.failed += 1
        self.failing += 1
        if self.failing_since is None:
            self.failing_since = time.time()
        self.last_error = f"checkpoint of step {step} failed: {reason}"
        durable = "none yet" if self.durable_step is None else f"step {self.durable_step}"
        log.warning("%s (durable: %s; trying again at the next due step)", self.last_error,
                    durable)  # fmt: skip
        if self._on_failure is not None:
            try:
                self._on_failure(step, reason)
            except Exception as exc:  # the report is best effort; the log has it
                log.warning("could not report the checkpoint failure: %s", exc)

    def _settle(
        self, manifest: CheckpointManifest, accepted: bool, kept: Sequence[CheckpointManifest]
    ) -> None:
        """After a publication: check the record, note what is durable,
        delete what it supersedes."""
        verified = {m.uri for m in kept if self._verify(m) is None}
        if accepted:
            self._durable(manifest.step)
        else:
            newer = [m for m in kept if m.step >= manifest.step]
            if any(m.uri in verified for m in newer):
                log.info("checkpoint of step %d not recorded: the record holds a newer one",
                         manifest.step)  # fmt: skip
            else:
                # Durability does not advance while the record is held by a
                # manifest nobody can load: that is a failure to surface.
                held = newer[0].step if newer else -1
                self._failed(
                    manifest.step,
                    f"not recorded: the job's record holds step {held}, which this writer "
                    "cannot verify (`rollcall checkpoints verify`)",
                )
        for m in kept:
            if m.uri in verified and self._may_own(m) and m.uri not in self._owned:
                named: list[CheckpointManifest | CheckpointPart] = [m, *m.parts]
                for file in named:
                    key = (file.uri, file.size, file.sha256)
                    self._owned[file.uri] = _Owned(m.step, file.size, self._checked[key][0][0])
        files = {uri: owned.step for uri, owned in self._owned.items()}
        for uri in superseded(files, kept, verified, manifest.step):
            self._delete(uri)

    def _durable(self, step: int) -> None:
        if self.failing:
            log.warning("checkpoints recorded again at step %d after %d failed attempts",
                        step, self.failing)  # fmt: skip
        self.failing, self.failing_since, self.last_error = 0, None, None
        self.durable_step = step
        if self._on_durable is not None:
            try:
                self._on_durable(step)
            except Exception as exc:
                log.warning("could not report the recorded checkpoint: %s", exc)

    def _may_own(self, manifest: CheckpointManifest) -> bool:
        """A manifest of this job names files in this directory, under this
        job's name patterns for its step: this writer may prune them later."""
        path = Path(manifest.uri)
        parts = [Path(part.uri) for part in manifest.parts]
        return (
            path.parent == self.directory
            and parse_file_name(path.name, self.job) == manifest.step
            and all(p.parent == self.directory for p in parts)
            and all(parse_part_name(p.name, self.job) == manifest.step for p in parts)
        )

    def _verify(self, manifest: CheckpointManifest) -> str | None:
        """The problem of the files ``manifest`` names, parts included
        (None: they are the files published), each read once per file
        version; a problem is logged once."""
        problem = self._step_problem(manifest)
        files: list[CheckpointManifest | CheckpointPart] = [manifest, *manifest.parts]
        for file in files:
            if problem is not None:
                break
            key = (file.uri, file.size, file.sha256)
            try:
                info = os.lstat(file.uri)
            except OSError as exc:
                problem = f"unreadable ({exc.strerror or exc})"
            else:
                cached = self._checked.get(key)
                if cached is not None and cached[0] == _identity(info):
                    problem = cached[1]
                else:
                    regular = stat.S_ISREG(info.st_mode)
                    problem = file_problem(file) if regular else "not a regular file"
                    self._checked[key] = (_identity(info), problem)
            if problem is not None and file is not manifest:
                problem = f"part {file.uri}: {problem}"
        if problem is not None and (manifest.uri, problem) not in self._warned:
            self._warned.add((manifest.uri, problem))
            log.warning(
                "the job's record names a checkpoint of step %d at %s that does not verify: "
                "%s; it is not trusted (nothing is deleted on its account)",
                manifest.step, manifest.uri, problem,
            )  # fmt: skip
        return problem

    def _step_problem(self, manifest: CheckpointManifest) -> str | None:
        """A manifest naming one of this job's files here must claim the
        step the file is named for."""
        path = Path(manifest.uri)
        named = parse_file_name(path.name, self.job) if path.parent == self.directory else None
        if named is not None and named != manifest.step:
            return f"the file is this job's checkpoint of step {named}"
        return None

    def _discard(self, manifest: CheckpointManifest) -> None:
        """Delete the files of a checkpoint that will never be published
        (its main file, the parts this writer wrote or found): nothing names
        them, and nobody else prunes them."""
        files: list[CheckpointManifest | CheckpointPart] = [manifest, *manifest.parts]
        for file in files:
            owned = self._owned.get(file.uri)
            if owned is not None and owned.step == manifest.step:
                self._delete(file.uri)

    def _delete(self, uri: str) -> None:
        """Delete a file this writer owns (superseded, or of a checkpoint
        never published), if it is still the one this writer knew, and the
        manifest copy beside it."""
        owned = self._owned.pop(uri)
        try:
            info = os.lstat(uri)
            if stat.S_ISREG(info.st_mode) and (info.st_size, info.st_ino) == (
                owned.size, owned.inode,
            ):  # fmt: skip
                os.unlink(uri)
                path = Path(uri)
                path.with_name(manifest_file_name(path.name)).unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete the checkpoint file %s: %s", uri, exc)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (0600) through a temporary name: synced,
    then renamed into place (the caller syncs the directory)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: never through a link planted under the temporary name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        with os.fdopen(os.open(temporary, flags, 0o600), "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        # The clean-up of a failed write may fail too (a read-only
        # directory refuses even that): the write's own error is the news.
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    return (info.st_ino, info.st_size, info.st_mtime_ns)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
