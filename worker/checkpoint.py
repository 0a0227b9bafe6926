"""Durable checkpoints on disk: written in the background, published only
when complete, loaded (newest usable first) when no live replica is left.

A checkpoint file holds ``worker.state.to_bytes`` of a committed step. The
writer writes it to a temporary name, syncs it, renames it into place and
syncs the directory; only then does it publish the manifest (size, SHA-256 of
the bytes, state digest) through the rendezvous service, which records it in
etcd. A reader trusts nothing it has not checked: size, SHA-256, that the
bytes load as a replica state, the state digest, and the step.

The directory must be one the whole job can read (shared storage) for a new
set of workers on other hosts to resume from it; a manifest whose file is
not readable is skipped like a corrupt one, with the reason logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from membership.checkpoint import FILE_PATTERN, CheckpointManifest, file_name
from membership.errors import CannotResume
from worker.state import CorruptState, ReplicaState, digest, from_bytes, to_bytes

__all__ = [
    "CheckpointUnusable",
    "CheckpointWriter",
    "Loaded",
    "load_newest",
    "process_age",
]

log = logging.getLogger("rollcall.checkpoint")

#: Publishes a complete checkpoint; returns (accepted, manifests kept).
Publish = Callable[[CheckpointManifest], tuple[bool, Sequence[CheckpointManifest]]]


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


def load_newest(manifests: Sequence[CheckpointManifest]) -> Loaded:
    """Load the newest checkpoint that passes every check; older ones are
    tried when a newer one is missing or corrupt. Raises
    :class:`CheckpointUnusable` naming each one's problem if none does."""
    started = time.perf_counter()
    skipped: list[str] = []
    for manifest in manifests:
        problem = None
        try:
            blob = Path(manifest.uri).read_bytes()
        except OSError as exc:
            problem = f"unreadable ({exc.strerror or exc})"
        else:
            if len(blob) != manifest.size:
                problem = f"{len(blob)} bytes, manifest says {manifest.size} (torn or replaced)"
            elif hashlib.sha256(blob).hexdigest() != manifest.sha256:
                problem = "SHA-256 differs from the manifest (corrupt)"
            else:
                try:
                    state = from_bytes(blob, expect_digest=manifest.digest)
                except CorruptState as exc:
                    problem = str(exc)
                else:
                    if state.step != manifest.step:
                        problem = f"holds step {state.step}, manifest says {manifest.step}"
        if problem is None:
            return Loaded(state, manifest, time.perf_counter() - started, tuple(skipped))
        reason = f"checkpoint of step {manifest.step} at {manifest.uri}: {problem}"
        log.warning("skipping %s", reason)
        skipped.append(reason)
    raise CheckpointUnusable(
        f"no usable checkpoint among the {len(manifests)} published: {'; '.join(skipped)}"
    )


def process_age() -> float:
    """Seconds since this process started."""
    return max(0.0, time.time() - psutil.Process().create_time())


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread.

    ``submit`` returns at once; while a write is in flight further submits
    are skipped (the next due step will be written instead), so a slow disk
    never stalls training.
    """

    def __init__(self, directory: Path, publish: Publish) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._publish = publish
        self._thread: threading.Thread | None = None
        self.written = 0
        self.skipped = 0
        self.last_error: str | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ready(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` can start now; if not (the
        previous one is still being written), it is skipped and counted."""
        if not self.busy:
            return True
        self.skipped += 1
        log.info("checkpoint of step %d skipped: the previous one is still being written", step)
        return False

    def submit(self, state: ReplicaState, epoch: int, writer: str, step_seconds: float) -> bool:
        """Write ``state`` (a capture the caller no longer touches) and
        publish it. False if a previous write is still in flight."""
        if not self.ready(state.step):
            return False
        self._thread = threading.Thread(
            target=self._write,
            args=(state, epoch, writer, step_seconds),
            name=f"rollcall-checkpoint-{state.step}",
            daemon=True,
        )
        self._thread.start()
        return True

    def wait(self, timeout: float) -> bool:
        """Wait for the write in flight; False if it is still running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def _write(self, state: ReplicaState, epoch: int, writer: str, step_seconds: float) -> None:
        started = time.perf_counter()
        path = self.directory / file_name(state.step)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            blob = to_bytes(state)
            with open(temporary, "wb") as file:
                file.write(blob)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
            _fsync_directory(self.directory)
            manifest = CheckpointManifest(
                step=state.step,
                digest=digest(state),
                uri=str(path.resolve()),
                size=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
                epoch=epoch,
                writer=writer,
                created_unix=time.time(),
                step_seconds=step_seconds,
            )
            accepted, kept = self._publish(manifest)
        except Exception as exc:  # reported, never lost: the next due step tries again
            self.last_error = f"checkpoint of step {state.step} failed: {exc}"
            log.warning("%s", self.last_error)
            temporary.unlink(missing_ok=True)
            return
        self.written += 1
        self.last_error = None
        outcome = "published" if accepted else "not published: a newer one exists"
        seconds = time.perf_counter() - started
        log.info("checkpoint of step %d: %d bytes in %.3f s, %s",
                 state.step, len(blob), seconds, outcome)  # fmt: skip
        self._prune(kept)

    def _prune(self, kept: Sequence[CheckpointManifest]) -> None:
        """Delete this directory's checkpoint files older than the oldest
        kept one (no kept manifest can name them)."""
        if not kept:
            return
        oldest = min(m.step for m in kept)  # every file is named by its step
        for candidate in self.directory.iterdir():
            match = FILE_PATTERN.fullmatch(candidate.name)
            if match and int(match.group(1)) < oldest:
                candidate.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
