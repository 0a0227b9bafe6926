"""``rollcall checkpoints list|verify|forget``: inspect and repair a job's
checkpoint record without etcdctl.

- ``list``: the recorded manifests (step, epoch, writer, size, file) and,
  for each file this machine can see, whether it is there with its size;
  the job's files beside them that no record names; then the job's
  durability.
- ``verify``: reads every recorded file and checks what a resuming worker
  checks (size, SHA-256, that it loads as a replica state, digest, step).
  Exit 1 if any fails.
- ``forget STEP...|--all``: removes manifests from the record (the
  ``ForgetCheckpoints`` RPC, leader only); the files stay unless
  ``--delete-files``, which deletes only files named like this job's
  checkpoints of the forgotten steps (never another file a manifest names).

This is how a job stuck at "no usable checkpoint" (``rollcall worker`` exit
4) gets going again: see ``rollcall.worker.checkpoint.RECOVERY``.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from rollcall.membership.checkpoint import (
    CheckpointManifest,
    CheckpointPart,
    Durability,
    is_job_file,
    manifest_file_name,
    parse_file_name,
    parse_part_name,
    started_over_file_name,
)
from rollcall.membership.config import Config

T = TypeVar("T")
#: Where a command goes: (replica addresses, job, token file), from the
#: flags or the local `up` (``rollcall.cli.options.resolve_target``).
Resolve = Callable[[str | None, str | None, Path | None], tuple[list[str], str, Path | None]]
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
#: Exit code when a checkpoint does not verify (a runtime failure).
EXIT_UNUSABLE = 1


def durability_line(durability: Durability) -> str | None:
    """One warning line while checkpoints fail, else None:
    ``durability stuck at step 299 since 12:03:04: No space left on device ...``."""
    failure = durability.failure
    if failure is None:
        return None
    at = "no checkpoint" if durability.durable_step is None else f"step {durability.durable_step}"
    since = time.strftime("%H:%M:%S", time.localtime(failure.since_unix))
    return (
        f"durability stuck at {at} since {since}: {failure.reason} ({failure.failures} failed "
        f"attempts, the latest at step {failure.step} by {failure.writer})"
    )


def durability_json(durability: Durability) -> dict[str, Any]:
    failure = durability.failure
    return {
        "durable_step": durability.durable_step,
        "failures": failure.failures if failure else 0,
        "failed_step": failure.step if failure else None,
        "reason": failure.reason if failure else None,
        "since": failure.since_unix if failure else None,
        "writer": failure.writer if failure else None,
    }


def file_state(manifest: CheckpointManifest | CheckpointPart) -> str:
    """What this machine sees of the file a manifest (or a part) names,
    without reading it; for a sharded checkpoint, of its parts too."""
    own = _one_file_state(manifest)
    if own != "present" or not isinstance(manifest, CheckpointManifest) or not manifest.parts:
        return own
    missing = [part for part in manifest.parts if _one_file_state(part) != "present"]
    if missing:
        return f"{len(missing)} of {len(manifest.parts)} parts: {_one_file_state(missing[0])}"
    return f"present, with its {len(manifest.parts)} parts"


def unrecorded_files(job: str, recorded: Sequence[CheckpointManifest]) -> list[tuple[Path, int]]:
    """``job``'s checkpoint and part files (path, size) that no recorded
    manifest names, in the directories the recorded ones are in (as far as
    this machine can list them): what a kill between writing a checkpoint
    and publishing it leaves, or what ``forget`` kept. A worker adopts them
    only if etcd loses the job's record; nothing deletes them."""
    named = {m.uri for m in recorded} | {p.uri for m in recorded for p in m.parts}
    found = []
    for directory in sorted({Path(m.uri).parent for m in recorded}):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = directory / name
            if not is_job_file(name, job) or str(path) in named:
                continue
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((path, info.st_size))
    return found


def _one_file_state(manifest: CheckpointManifest | CheckpointPart) -> str:
    try:
        info = os.stat(manifest.uri)
    except OSError as exc:
        return f"not visible here ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size != manifest.size:
        return f"{info.st_size} bytes, manifest says {manifest.size}"
    return "present"


def _run(
    resolve: Resolve, addresses: str | None, job: str | None, token_file: Path | None,
    timeout: float, call: Callable[[Any], Awaitable[T]],
) -> tuple[str, T]:  # fmt: skip
    """Run ``call(client)`` against the job (given, or the local `up`)."""
    from rollcall.protocol.client import RendezvousClient
    from rollcall.protocol.wire import read_token

    replicas, name, token_file = resolve(addresses, job, token_file)
    token = read_token(token_file)
    config = Config(client_call_deadline=timeout)

    async def ask() -> T:
        client = RendezvousClient(replicas, name, token, config)
        try:
            return await call(client)
        finally:
            await client.close()

    return name, asyncio.run(ask())


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def build(resolve: Resolve, target_options: Decorator, token_option: Decorator) -> click.Group:
    """The ``checkpoints`` command group, with the target options and their
    resolution of ``rollcall.cli.options`` (passed in: this module does not import
    the command line it is part of)."""

    def common_options(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = token_option(fn)
        fn = target_options(fn)
        return click.option(
            "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
            help="Give up after this many seconds.",
        )(fn)  # fmt: skip

    @click.group()
    def checkpoints() -> None:
        """Inspect and repair a job's checkpoint record (the manifests in
        etcd): the local `rollcall up`'s without flags, or --rendezvous and
        --job."""

    @checkpoints.command("list")
    @common_options
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    def list_command(
        addresses: str | None, job: str | None, token_file: Path | None, timeout: float,
        as_json: bool,
    ) -> None:  # fmt: skip
        """The recorded checkpoints, newest first, the job's files beside them
        that no record names, and the job's durability."""
        name, status = _run(resolve, addresses, job, token_file, timeout, lambda c: c.status())
        unrecorded = unrecorded_files(name, status.checkpoints)
        if as_json:
            records = [{**m.to_dict(), "file": file_state(m)} for m in status.checkpoints]
            click.echo(
                json.dumps(
                    {
                        "job": name,
                        "last_step": status.last_step,
                        "checkpoints": records,
                        "unrecorded": [{"path": str(p), "size": n} for p, n in unrecorded],
                        "durability": durability_json(status.durability),
                    }  # fmt: skip
                )
            )
            return
        progress = "-" if status.last_step is None else str(status.last_step)
        click.echo(
            f"job {name}: {len(status.checkpoints)} checkpoints recorded, last step {progress}"
        )
        for m in status.checkpoints:
            click.echo(
                f"  step {m.step:>8}  epoch {m.epoch:>4}  {m.size:>11} bytes  "
                f"{_when(m.created_unix)}  by {m.writer}\n      {m.uri}  [{file_state(m)}]"
            )
        if unrecorded:
            beside = {p.parent / started_over_file_name(name) for p, _ in unrecorded}
            lists = sorted(str(path) for path in beside if path.is_file())
            never = (
                f" (never those {', '.join(lists)} lists: they are of a run started over)"
                if lists
                else ""
            )
            click.echo(
                f"{len(unrecorded)} files of job {name} beside them are named in no record "
                f"({sum(n for _, n in unrecorded)} bytes): left by a kill between writing and "
                "publishing, kept by forget, or of a run started over. Workers adopt them only "
                f"if etcd loses the job's record{never}; delete them by hand if you do not "
                "need them:"
            )
            for path, _ in unrecorded:
                click.echo(f"      {path}")
        line = durability_line(status.durability)
        if line is not None:
            click.echo(f"warning: {line}")

    @checkpoints.command()
    @common_options
    def verify(
        addresses: str | None, job: str | None, token_file: Path | None, timeout: float
    ) -> None:
        """Read every recorded checkpoint and check it as a resuming worker
        would: size, SHA-256, that it loads, state digest, step. Exit 1 if
        any fails."""
        from rollcall.worker.checkpoint import state_problem

        name, status = _run(resolve, addresses, job, token_file, timeout, lambda c: c.status())
        if not status.checkpoints:
            click.echo(f"job {name}: no checkpoint recorded")
            return
        bad = 0
        for m in status.checkpoints:
            _, problem = state_problem(m)
            bad += problem is not None
            click.echo(f"step {m.step:>8}  {'ok' if problem is None else problem}  {m.uri}")
        if bad:
            click.echo(
                f"{bad} of {len(status.checkpoints)} checkpoints of job {name} are unusable; "
                "`rollcall checkpoints forget STEP` removes one from the record",
                err=True,
            )
            raise SystemExit(EXIT_UNUSABLE)
        click.echo(f"all {len(status.checkpoints)} checkpoints of job {name} verify")

    @checkpoints.command()
    @click.argument("steps", nargs=-1, type=click.IntRange(min=0))
    @click.option("--all", "forget_all", is_flag=True, help="Forget every recorded checkpoint.")
    @click.option(
        "--delete-files", is_flag=True,
        help="Also delete the forgotten checkpoints' files (only files named as this job's "
             "checkpoint of that step, visible from here).",
    )  # fmt: skip
    @common_options
    def forget(
        steps: tuple[int, ...], forget_all: bool, delete_files: bool, addresses: str | None,
        job: str | None, token_file: Path | None, timeout: float,
    ) -> None:  # fmt: skip
        """Remove the manifests of STEP... (or --all) from the job's
        checkpoint record; the files stay unless --delete-files. A resuming
        worker then no longer tries them; with none left, a job that has
        progress starts over only when asked to (--start-over)."""
        if forget_all == bool(steps):
            raise click.UsageError("give the STEPs to forget, or --all")
        chosen: Sequence[int] | None = None if forget_all else steps
        name, (forgotten, kept) = _run(
            resolve, addresses, job, token_file, timeout, lambda c: c.forget_checkpoints(chosen)
        )
        for m in forgotten:
            outcome = _delete(m, name) if delete_files else "file kept"
            click.echo(f"forgot the checkpoint of step {m.step} ({outcome}: {m.uri})")
        if not forgotten:
            click.echo(f"job {name}: no checkpoint was recorded")
        click.echo(f"job {name}: {len(kept)} checkpoints still recorded")

    return checkpoints


def _delete(manifest: CheckpointManifest, job: str) -> str:
    """Delete a forgotten checkpoint's file, if it is one: a regular file
    named as ``job``'s checkpoint of the manifest's step; and its parts, each
    only if named as ``job``'s part of that step. A forged manifest may name
    any file; this never deletes one that is not a checkpoint."""
    path = Path(manifest.uri)
    if parse_file_name(path.name, job) != manifest.step:
        return f"file kept: not named as job {job}'s checkpoint of step {manifest.step}"
    outcome = _unlink(path)
    if outcome is not None:
        return outcome
    path.with_name(manifest_file_name(path.name)).unlink(missing_ok=True)
    kept = 0
    for part in manifest.parts:
        named = Path(part.uri)
        if parse_part_name(named.name, job) != manifest.step or _unlink(named) is not None:
            kept += 1
    if kept:
        return f"file deleted, {kept} of its {len(manifest.parts)} parts kept"
    return "file deleted" + (f" with its {len(manifest.parts)} parts" if manifest.parts else "")


def _unlink(path: Path) -> str | None:
    """Delete a regular file; why not, or None once deleted."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "file kept: not a regular file"
        path.unlink()
    except OSError as exc:
        return f"file not deleted ({exc.strerror or exc})"
    return None


__all__ = ["build", "durability_json", "durability_line"]
