"""``rollcall up``: a local cluster (an embedded etcd, a rendezvous service and
workers training) with a live view."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rollcall.cli.control_plane import etcd_auth_dir, private_workdir, secure_etcd
from rollcall.cli.group import EXIT_USAGE, fail
from rollcall.cli.options import (
    check_job,
    config_option,
    log_level_option,
    parse_overrides,
    setup_logging,
)
from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError

if TYPE_CHECKING:
    from rollcall.local import WorkerOptions


#: `up` options that configure the built-in example: refused with a COMMAND.
EXAMPLE_ONLY = ("steps", "global_batch", "micro_batch", "d_model", "layers", "checkpoint_every")


@click.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--workers",
    type=click.IntRange(0, 64),
    default=4,
    show_default=True,
    help="Workers to start: copies of COMMAND, or of the built-in example "
    "(0: the control plane only).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="Example only: steps the job trains for; `up` ends when the workers are done.",
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write view-change events here (default: in the work directory).",
)
@click.option("--job", default="dev", show_default=True, callback=check_job, help="Job name.")
@click.option(
    "--listen",
    default="127.0.0.1:0",
    show_default=True,
    metavar="HOST:PORT",
    help="Address of the rendezvous service (port 0 picks a free one).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep etcd's data, the token, checkpoints and logs here; it must be new "
    "or open to this user only (default: a temporary directory, deleted on "
    "exit). Created with mode 0700; one `up` at a time (up.lock).",
)
@click.option(
    "--global-batch",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Example only.",
)
@click.option(
    "--micro-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Example only."
)
@click.option(
    "--d-model",
    type=click.IntRange(min=4),
    default=64,
    show_default=True,
    help="Example only: model width.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Example only: model depth.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Example only: durable checkpoint every N steps.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve the rendezvous service's Prometheus metrics on this port.",
)
@click.option(
    "--live/--no-live",
    default=None,
    help="Live terminal view (default: when stdout is a terminal).",
)
@log_level_option("warning")
@config_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND [ARGS]...]")
def up(
    workers: int, steps: int, events: Path | None, job: str, listen: str,
    data_dir: Path | None, global_batch: int, micro_batch: int, d_model: int, layers: int,
    checkpoint_every: int, metrics_port: int | None, live: bool | None, log_level: str,
    overrides: tuple[str, ...], command: tuple[str, ...],
) -> None:  # fmt: skip
    """Run a local cluster: an embedded etcd, a rendezvous service and
    workers training, with a live view. The workers are copies of COMMAND
    (e.g. `rollcall up --workers 3 -- python train.py --lr 0.1`), or of the
    built-in example without one.

    Each copy of COMMAND finds the job in its environment:
    ROLLCALL_RENDEZVOUS, ROLLCALL_JOB, ROLLCALL_TOKEN_FILE, ROLLCALL_NAME
    (w0, w1, ...), ROLLCALL_CHECKPOINT_DIR, and ROLLCALL_REPORT_FD, through
    which its runtime reports its state to `up`. Its output goes to
    workers/wN.log in the work directory. When it exits, what it left in its
    process group is killed.

    Operate it from another terminal with `rollcall add`, `rollcall kill`,
    `rollcall chaos` and `rollcall status` (they find it without flags).
    It ends when some worker has finished its steps and none is left
    running; with exit code 1 when every worker ended with an error (the
    script's or the runtime's, or an exit before its runtime reported its
    end: a missing module, a command that never joined the job; a worker
    killed by a signal leaves room for `rollcall add`) and none is left
    running; or on Ctrl-C, which stops
    everything it started (SIGINT first, SIGKILL after 15 s). --set applies
    to the rendezvous service and to the example workers; a COMMAND's
    runtime uses its own settings.
    """
    from rollcall.etcd_local import LocalEtcd
    from rollcall.local import WorkerOptions
    from rollcall.protocol.wire import write_token_file

    config = parse_overrides(overrides)
    if command:
        refuse_example_flags(click.get_current_context())
        check_executable(command[0])
        options = WorkerOptions(command=command)
    else:
        if global_batch % micro_batch:
            raise click.UsageError("--global-batch must be a multiple of --micro-batch")
        options = WorkerOptions(
            steps=steps,
            worker_args=[
                f"--global-batch={global_batch}", f"--micro-batch={micro_batch}",
                f"--d-model={d_model}", f"--layers={layers}",
                f"--checkpoint-every={checkpoint_every}",
                *(f"--set={item}" for item in overrides),
            ],
        )  # fmt: skip
    owned = data_dir is None
    workdir = private_workdir(data_dir)
    lock = lock_workdir(workdir)
    token_file = workdir / "token"
    write_token_file(token_file, os.environ.get("ROLLCALL_TOKEN") or secrets.token_urlsafe(24))
    events_path = events or workdir / "events.jsonl"
    setup_logging(log_level)
    # Ports bound once etcd runs are none it may pick (a fixed port given to
    # --listen or --metrics-port is seldom one the OS hands out, but may be).
    listen_port = listen.rpartition(":")[2]
    bound_later = [int(listen_port) if listen_port.isdigit() else 0, metrics_port or 0]
    server = LocalEtcd(data_dir=workdir / "etcd", avoid=[p for p in bound_later if p])
    server.start()
    try:
        credentials = secure_etcd([server.endpoint], etcd_auth_dir(server.data_dir))
        failure = asyncio.run(
            _run_up(
                server.endpoint, workdir, job, listen, token_file, events_path, config,
                workers, options, metrics_port, sys.stdout.isatty() if live is None else live,
                credentials,
            )
        )  # fmt: skip
    finally:
        server.stop()
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
        os.close(lock)
        click.echo("rollcall up: stopped", err=True)
    if failure is not None:
        fail(f"every worker ended with an error and none is left running: {failure}")


def refuse_example_flags(ctx: click.Context) -> None:
    """A COMMAND is the user's program: the example's flags mean nothing to it."""
    from click.core import ParameterSource

    given = [
        f"--{name.replace('_', '-')}"
        for name in EXAMPLE_ONLY
        if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: only for the built-in example, not with a COMMAND"
        )


def check_executable(program: str) -> None:
    """Refuse a COMMAND that cannot be started before anything is started."""
    if shutil.which(program) is not None:
        return
    path = Path(program)
    if os.sep not in program:
        fail(f"cannot run {program!r}: no such command on PATH", EXIT_USAGE)
    if not path.exists():
        fail(f"cannot run {program!r}: no such file", EXIT_USAGE)
    what = "a directory" if path.is_dir() else "not executable"
    fail(f"cannot run {program!r}: it is {what}", EXIT_USAGE)


#: In `up`'s work directory: the pid of the `up` that holds it.
LOCK_NAME = "up.lock"


def lock_workdir(workdir: Path) -> int:
    """Hold `up`'s lock on ``workdir`` (an flock, released by the kernel
    when the holder dies however it dies, so a stale lock file is simply
    taken over) and write this pid in it; the descriptor, to close at the
    end. Another `up` holding it is one line, at once."""
    import fcntl

    fd = os.open(workdir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        fail(
            f"another `rollcall up` (pid {holder}) runs on --data-dir {workdir}: "
            "stop it first, or pass another --data-dir"
        )
    os.fchmod(fd, 0o600)  # a lock file left behind may have another mode
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def _run_up(
    etcd: str, workdir: Path, job: str, listen: str, token_file: Path, events: Path,
    config: Config, workers: int, options: WorkerOptions, metrics_port: int | None, live: bool,
    etcd_auth: Any,
) -> str | None:  # fmt: skip
    """Run the cluster until it is done, Ctrl-C, or every worker failed;
    returns the first failure in the last case."""
    from rollcall.local import LocalCluster, summarize
    from rollcall.protocol.client import RendezvousClient
    from rollcall.rendezvous.etcd_auth import password_file
    from rollcall.rendezvous.server import ReplicaOptions, start_replica

    token = token_file.read_text().strip()
    running = await start_replica(
        ReplicaOptions(
            etcd=[etcd], job=job, listen=listen, token=token, config=config, events=events,
            metrics_port=metrics_port, etcd_auth=etcd_auth,
        )
    )  # fmt: skip
    cluster = LocalCluster(workdir, job, token_file, running.address, etcd, events, options)
    client = RendezvousClient([running.address], job, token, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    click.echo(
        f"rollcall up: etcd at {etcd}, rendezvous at {running.address}, job {job}\n"
        f"  token file: {token_file}\n  events:     {events}\n"
        f"  etcd auth:  user {etcd_auth.user}, password in "
        f"{password_file(etcd_auth_dir(workdir / 'etcd'))}\n"
        + (f"  metrics:    http://{running.metrics_address}/metrics\n"
           if running.metrics_address else "")
        + f"  workers:    {options.label}; logs in {workdir / 'workers'}\n"
        f"  status:     rollcall status   (or --rendezvous {running.address} --job {job} "
        f"--token-file {token_file})\n  Ctrl-C stops everything."
    )  # fmt: skip
    try:
        await cluster.open_control()
        await cluster.add(workers)
        await _watch_up(cluster, client, stop, live)
    finally:
        await cluster.stop()
        if live:
            click.echo()
        summary = summarize(events)
        goodput = summary["goodput"]
        click.echo(
            f"rollcall up: {len(summary['view_changes'])} view changes, goodput "
            f"{'-' if goodput is None else f'{goodput:.3f}'}; events in {events}"
        )
        await client.close()
        await running.stop()
    return cluster.failed


async def _watch_up(cluster: Any, client: Any, stop: asyncio.Event, live: bool) -> None:
    """Refresh the view until Ctrl-C or the job is done."""
    from rich.console import Console
    from rich.live import Live

    from rollcall.live import event_line, headline, render
    from rollcall.local import summarize

    status = None
    printed = noticed = 0
    last_line = 0.0
    console = Console()
    display = Live(console=console, refresh_per_second=4, transient=False) if live else None
    with display if display is not None else contextlib.nullcontext():
        while not stop.is_set() and not cluster.finished and cluster.failed is None:
            try:
                status = await asyncio.wait_for(client.status(), 2.0)
            except (RollcallError, TimeoutError):
                pass
            summary = summarize(cluster.events)
            if display is not None:
                display.update(render(cluster, status, summary))
            else:
                for event in summary["view_changes"][printed:]:
                    click.echo(event_line(event))
                printed = len(summary["view_changes"])
                for notice in cluster.notices[noticed:]:
                    click.echo(notice)
                noticed = len(cluster.notices)
                if time.monotonic() - last_line > 5:
                    last_line = time.monotonic()
                    click.echo(headline(cluster, status, summary))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
