"""The ``rollcall`` command line.

Every failure the user can cause or meet (a bad flag, etcd unreachable, a
wrong token, no such job) ends as one line on stderr and a non-zero exit,
never a traceback. Heavy imports happen inside the commands, so ``--help``
and argument errors are instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError

if TYPE_CHECKING:
    from rollcall.local import WorkerOptions

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes: 1 for a runtime failure, 2 for bad usage (as click does).
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: ``rollcall worker``: its settings differ from its job's (ConfigurationMismatch).
EXIT_MISMATCH = 5
#: ``rollcall worker``: etcd lost the job's data and no replica remembered it
#: (JobRecordLost): the worker cannot rejoin under its old id.
EXIT_RECORD_LOST = 6


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    click.echo(f"rollcall: error: {message}", err=True)
    sys.exit(code)


class RollcallGroup(click.Group):
    """Turns every expected error into one line on stderr."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Abort:
            sys.exit(130)
        except click.UsageError as exc:
            hint = f" (see 'rollcall {exc.ctx.info_name} --help')" if exc.ctx else ""
            if exc.ctx and exc.ctx.info_name == "rollcall":
                hint = " (see 'rollcall --help')"
            fail(f"{exc.format_message()}{hint}", EXIT_USAGE)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code or EXIT_FAILURE)
        except RollcallError as exc:
            fail(str(exc))
        except (OSError, ValueError) as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            sys.exit(130)


def parse_overrides(values: tuple[str, ...]) -> Config:
    """``--set name=value`` pairs applied to the default ``Config``."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    changes: dict[str, Any] = {}
    for item in values:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            known = ", ".join(sorted(fields))
            raise click.BadParameter(f"{item!r} is not NAME=VALUE with NAME one of: {known}")
        kind = type(getattr(Config(), name))
        try:
            changes[name] = kind(raw)
        except ValueError:
            raise click.BadParameter(f"{name} needs a {kind.__name__}, got {raw!r}") from None
    try:
        return Config(**changes)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def config_option(fn: F) -> F:
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="NAME=VALUE",
        help="Override a config field (see membership/config.py), e.g. --set phi_threshold=10.",
    )(fn)


def token_option(fn: F) -> F:
    return click.option(
        "--token-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="File holding the job token (default: the file named by $ROLLCALL_TOKEN_FILE, "
        "else $ROLLCALL_TOKEN).",
    )(fn)


def check_job(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--job`` by the service's own rules (``rollcall.protocol.validation``), so a
    bad name is refused here at once rather than by the service later."""
    if value is None:
        return None
    from rollcall.membership.errors import InvalidRequest
    from rollcall.protocol.validation import check_id

    try:
        return check_id(value, "job name", Config())
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc)) from None


def split_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


@click.group(cls=RollcallGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torch-rollcall")
def main() -> None:
    """rollcall: keep-alive membership for elastic PyTorch training."""
    # A program started in the background of a non-interactive shell
    # inherits SIGINT ignored; every rollcall command stops on Ctrl-C.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep etcd's data and the auth/ passwords here, mode 0700 (default: a temporary "
         "directory, deleted on exit).",
)
@click.option(
    "--client-port",
    type=click.IntRange(0, 65535),
    default=2379,
    show_default=True,
    help="Client port on 127.0.0.1 (0 picks a free one).",
)
@click.option(
    "--peer-port",
    type=click.IntRange(0, 65535),
    default=2380,
    show_default=True,
    help="Peer port on 127.0.0.1 (0 picks a free one).",
)
@click.option(
    "--no-auth", is_flag=True,
    help="Leave authentication off: anyone who can reach the port reads and writes everything.",
)  # fmt: skip
def etcd(data_dir: Path | None, client_port: int, peer_port: int, no_auth: bool) -> None:
    """Run a local single-member etcd for development until Ctrl-C.

    Authentication is on: a root user and a rollcall user whose role reads
    and writes /rollcall/ only, their passwords generated at the first
    start into the auth directory of the data directory (mode 0700, files
    0600) and kept there. It prints how to connect."""
    from rollcall.etcd_local import LocalEtcd

    if data_dir is not None:
        private_workdir(data_dir, "--data-dir")
    server = LocalEtcd(data_dir=data_dir, client_port=client_port, peer_port=peer_port)
    server.start()
    try:
        click.echo(f"etcd ready at {server.endpoint} (data in {server.data_dir}); Ctrl-C stops it")
        if no_auth:
            click.echo("  authentication: off (--no-auth)")
        else:
            credentials = secure_etcd([server.endpoint], etcd_auth_dir(server.data_dir))
            click.echo(connect_lines(server.endpoint, etcd_auth_dir(server.data_dir), credentials))
        wait_for_signal()
    finally:
        server.stop()
        click.echo("etcd stopped", err=True)


def etcd_auth_dir(data_dir: Path) -> Path:
    """Where ``rollcall etcd`` and ``rollcall up`` keep etcd's passwords."""
    return data_dir / "auth"


def secure_etcd(endpoints: list[str], directory: Path) -> Any:
    """Authentication on in the etcd at ``endpoints``; the rollcall user's
    credentials (``rollcall.rendezvous.etcd_auth.enable_auth``)."""
    from rollcall.rendezvous.etcd_auth import enable_auth

    return enable_auth(endpoints, directory)


def connect_lines(endpoint: str, directory: Path, credentials: Any) -> str:
    from rollcall.rendezvous.etcd_auth import ROOT_USER, password_file

    password = password_file(directory)
    return (
        f"  authentication: on; user {credentials.user} (reads and writes /rollcall/ only), "
        f"password in {password}; etcd's {ROOT_USER} password in "
        f"{password_file(directory, ROOT_USER)}\n"
        f"  rendezvous:     rollcall rendezvous --etcd {endpoint} --etcd-user {credentials.user} "
        f"--etcd-password-file {password} --listen HOST:PORT --job NAME\n"
        f"  etcdctl:        etcdctl --endpoints={endpoint} "
        f"--user {credentials.user}:\"$(cat {password})\" get --prefix /rollcall/"
    )


@main.command("etcd-auth")
@click.option("--etcd", "etcd_urls", required=True, metavar="URL[,URL...]",
              help="etcd endpoints (plain http), e.g. http://127.0.0.1:2379.")
@click.option("--dir", "directory", required=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Where the passwords are kept (created with mode 0700; files 0600).")
def etcd_auth(etcd_urls: str, directory: Path) -> None:  # fmt: skip
    """Turn authentication on in a running etcd (idempotent).

    Creates a root user and a rollcall user whose role reads and writes
    /rollcall/ only, with passwords generated into --dir unless they are
    there already, and enables authentication. If it is on already, checks
    that the kept passwords are etcd's. The deployment of deploy/ runs it
    once before its rendezvous replicas start."""
    endpoints = split_list(etcd_urls)
    credentials = secure_etcd(endpoints, directory)
    click.echo(f"etcd at {', '.join(endpoints)}: authentication on")
    click.echo(connect_lines(endpoints[0], directory, credentials))


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received:
            signal.pause()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@main.command()
@click.option(
    "--etcd",
    "etcd_urls",
    required=True,
    metavar="URL[,URL...]",
    help="etcd endpoints, e.g. http://127.0.0.1:2379.",
)
@click.option("--listen", required=True, metavar="HOST:PORT", help="Address to serve gRPC on.")
@click.option("--job", required=True, callback=check_job,
              help="Name of the job this replica serves.")  # fmt: skip
@click.option(
    "--advertise",
    metavar="HOST:PORT",
    help="Address workers reach this replica at (default: from --listen).",
)
@token_option
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False), help="Server certificate (PEM)."
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), help="Server private key (PEM)."
)
@click.option(
    "--tls-client-ca",
    type=click.Path(exists=True, dir_okay=False),
    help="Require client certificates signed by this CA.",
)
@click.option(
    "--etcd-ca", type=click.Path(exists=True, dir_okay=False), help="CA of etcd's certificate."
)
@click.option(
    "--etcd-cert", type=click.Path(exists=True, dir_okay=False), help="Client certificate for etcd."
)
@click.option(
    "--etcd-key", type=click.Path(exists=True, dir_okay=False), help="Client key for etcd."
)
@click.option("--etcd-user", help="etcd user to authenticate as (with --etcd-password-file).")
@click.option(
    "--etcd-password-file", type=click.Path(dir_okay=False, path_type=Path),
    help="File holding the etcd user's password (rollcall etcd prints where it is).",
)  # fmt: skip
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append one JSON line per view change to this file (docs/events.md).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (0 picks a free one).",
)
@click.option(
    "--metrics-host", default="127.0.0.1", show_default=True, help="Address of the metrics port."
)
@config_option
def rendezvous(
    etcd_urls: str,
    listen: str,
    job: str,
    advertise: str | None,
    token_file: Path | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    etcd_ca: str | None,
    etcd_cert: str | None,
    etcd_key: str | None,
    etcd_user: str | None,
    etcd_password_file: Path | None,
    log_level: str,
    events: Path | None,
    metrics_port: int | None,
    metrics_host: str,
    overrides: tuple[str, ...],
) -> None:
    """Run a rendezvous replica for one job (several may share one etcd)."""
    from rollcall.protocol.wire import read_token
    from rollcall.rendezvous.etcd_client import EtcdClientTLS
    from rollcall.rendezvous.server import ReplicaOptions, ServerTLS, serve_until_signalled

    config = parse_overrides(overrides)
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    if (etcd_cert or etcd_key) and not etcd_ca:
        raise click.UsageError("--etcd-cert/--etcd-key need --etcd-ca")
    if bool(etcd_user) != bool(etcd_password_file):
        raise click.UsageError("--etcd-user and --etcd-password-file go together")
    from rollcall.rendezvous.etcd_auth import EtcdCredentials

    credentials = (
        EtcdCredentials.from_file(etcd_user, etcd_password_file)
        if etcd_user and etcd_password_file
        else None
    )
    options = ReplicaOptions(
        etcd=split_list(etcd_urls),
        job=job,
        listen=listen,
        token=read_token(token_file),
        advertise=advertise,
        config=config,
        tls=ServerTLS(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None,
        etcd_tls=EtcdClientTLS(etcd_ca, etcd_cert, etcd_key) if etcd_ca else None,
        etcd_auth=credentials,
        events=events,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    setup_logging(log_level)
    asyncio.run(serve_until_signalled(options, ready="rendezvous ready at {address}"))


def target_options(fn: F) -> F:
    """--rendezvous and --job, both optional: without them the command
    talks to the `rollcall up` running on this machine."""
    fn = click.option(
        "--job", callback=check_job, help="Job name (default: that of the local `rollcall up`)."
    )(fn)
    return click.option(
        "--rendezvous",
        "addresses",
        metavar="HOST:PORT[,...]",
        help="Rendezvous replica addresses (default: the local `rollcall up`).",
    )(fn)


def resolve_target(
    addresses: str | None, job: str | None, token_file: Path | None
) -> tuple[list[str], str, Path | None]:
    """Where a command goes: the given deployment, or the local `up`."""
    if addresses and job:
        return split_list(addresses), job, token_file
    if addresses or job:
        raise click.UsageError("--rendezvous and --job go together")
    from rollcall.local import find_local

    return local_target(find_local(), token_file)


def local_target(
    record: dict[str, Any], token_file: Path | None
) -> tuple[list[str], str, Path | None]:
    """Where a command goes to reach the local `up` of discovery ``record``."""
    return [record["rendezvous"]], record["job"], token_file or Path(record["token_file"])


@main.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@token_option
@click.option(
    "--tls-ca",
    type=click.Path(exists=True, dir_okay=False),
    help="CA of the service's certificate.",
)
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False), help="Client certificate."
)
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="Client key.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Give up after this many seconds.",
)
def status(
    addresses: str | None,
    job: str | None,
    as_json: bool,
    token_file: Path | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    timeout: float,
) -> None:
    """Show a job's current view, leader and last committed step."""
    from rollcall.checkpoints import durability_json, durability_line
    from rollcall.local import find_local
    from rollcall.protocol.client import ClientTLS, RendezvousClient
    from rollcall.protocol.wire import read_token

    local = None if addresses or job else find_local()
    if local is None:
        replicas, job, token_file = resolve_target(addresses, job, token_file)
    else:
        replicas, job, token_file = local_target(local, token_file)
    token = read_token(token_file)
    tls = ClientTLS(tls_ca, tls_cert, tls_key) if tls_ca else None
    config = Config(client_call_deadline=timeout)

    async def ask() -> Any:
        client = RendezvousClient(replicas, job, token, config, tls)
        try:
            return await client.status()
        finally:
            await client.close()

    result = asyncio.run(ask())
    members = [
        {"id": m.id, "rank": r, "address": m.address} for r, m in enumerate(result.view.members)
    ]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "job": job,
                    "epoch": result.view.epoch,
                    "members": members,
                    "leader": result.leader or None,
                    "step": result.step,
                    "replica": result.replica,
                    "rollcall_epoch": result.rollcall_epoch or None,
                    "last_step": result.last_step,
                    "checkpoints": [m.to_dict() for m in result.checkpoints],
                    "durability": durability_json(result.durability),
                }
            )
        )
        return
    step = "-" if result.step is None else str(result.step)
    click.echo(f"job {job}  epoch {result.view.epoch}  step {step}  leader {result.leader or '-'}")
    if local is not None:
        runs = shlex.join(local["command"]) if local.get("command") else "the built-in example"
        click.echo(
            f"local `rollcall up` (pid {local['pid']}) runs {runs}; "
            f"work directory {local['workdir']}"
        )
    if not members:
        click.echo("no members")
    for m in members:
        click.echo(f"  rank {m['rank']:>3}  {m['id']:<24} {m['address']}")
    if result.checkpoints:
        newest = result.checkpoints[0]
        click.echo(
            f"newest checkpoint: step {newest.step}  {newest.uri}  ({newest.size} bytes, "
            f"{len(result.checkpoints)} kept)"
        )
    stuck = durability_line(result.durability)
    if stuck is not None:
        click.echo(f"warning: {stuck}")


#: `up` options that configure the built-in example: refused with a COMMAND.
EXAMPLE_ONLY = ("steps", "global_batch", "micro_batch", "d_model", "layers", "checkpoint_every")


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--workers", type=click.IntRange(0, 64), default=4, show_default=True,
              help="Workers to start: copies of COMMAND, or of the built-in example "
                   "(0: the control plane only).")
@click.option("--steps", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Example only: steps the job trains for; `up` ends when the workers are done.")
@click.option("--events", type=click.Path(dir_okay=False, path_type=Path),
              help="Write view-change events here (default: in the work directory).")
@click.option("--job", default="dev", show_default=True, callback=check_job, help="Job name.")
@click.option("--listen", default="127.0.0.1:0", show_default=True, metavar="HOST:PORT",
              help="Address of the rendezvous service (port 0 picks a free one).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep etcd's data, the token, checkpoints and logs here; it must be new "
                   "or open to this user only (default: a temporary directory, deleted on "
                   "exit). Created with mode 0700; one `up` at a time (up.lock).")
@click.option("--global-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Example only.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Example only.")
@click.option("--d-model", type=click.IntRange(min=4), default=64, show_default=True,
              help="Example only: model width.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Example only: model depth.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Example only: durable checkpoint every N steps.")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve the rendezvous service's Prometheus metrics on this port.")
@click.option("--live/--no-live", default=None,
              help="Live terminal view (default: when stdout is a terminal).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="warning", show_default=True)
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
    running, or on Ctrl-C, which stops everything it started (SIGINT first,
    SIGKILL after 15 s). --set applies to the rendezvous service and to the
    example workers; a COMMAND's runtime uses its own settings.
    """
    from rollcall.etcd_local import LocalEtcd, free_port
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
    server = LocalEtcd(data_dir=workdir / "etcd", client_port=free_port(), peer_port=free_port())
    server.start()
    try:
        credentials = secure_etcd([server.endpoint], etcd_auth_dir(server.data_dir))
        asyncio.run(
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


def private_workdir(data_dir: Path | None, what: str = "--data-dir") -> Path:
    """`up`'s work directory (the token, the control socket, checkpoints,
    logs), open to this user only: a new temporary one, or ``data_dir``,
    created 0700 if new and refused if another user owns it or others may
    enter it (``rollcall.private``)."""
    if data_dir is None:
        return Path(tempfile.mkdtemp(prefix="rollcall-up-"))  # mkdtemp makes it 0700
    from rollcall.private import private_directory

    return private_directory(data_dir, what)


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
) -> None:  # fmt: skip
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
        while not stop.is_set() and not cluster.finished:
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


def operator_options(fn: F) -> F:
    """Where workers started against a deployment run and log."""
    fn = click.option(
        "--log-dir", type=click.Path(file_okay=False, path_type=Path),
        help="Deployment only: logs of the workers started here "
             "(default: /tmp/rollcall-workers-UID).",
    )(fn)  # fmt: skip
    return click.option(
        "--host", default="127.0.0.1", show_default=True,
        help="Deployment only: address peers reach the workers started here at.",
    )(fn)  # fmt: skip


def make_operator(
    addresses: str | None, job: str | None, token_file: Path | None, host: str,
    log_dir: Path | None,
) -> Any:  # fmt: skip
    """The local `up`'s operator, or one for the given deployment."""
    from rollcall.local import DeploymentOperator, LocalOperator, find_local

    if not addresses and not job:
        return LocalOperator(find_local())
    replicas, job, token_file = resolve_target(addresses, job, token_file)
    return DeploymentOperator(replicas, job, token_file, host, log_dir)


@main.command()
@click.option("--count", type=click.IntRange(1, 64), default=1, show_default=True)
@target_options
@token_option
@operator_options
def add(
    count: int, addresses: str | None, job: str | None, token_file: Path | None, host: str,
    log_dir: Path | None,
) -> None:  # fmt: skip
    """Hot-add workers: to the `rollcall up` running on this machine (more
    copies of what it runs, its COMMAND or the example), or (with
    --rendezvous and --job) to a deployment, as detached example worker
    processes on this machine."""
    operator = make_operator(addresses, job, token_file, host, log_dir)

    async def start() -> list[str]:
        return [await operator.add() for _ in range(count)]

    for started in asyncio.run(start()):
        click.echo(f"started {started}")


@main.command()
@click.argument("member", required=False)
@click.option("--random", "pick_random", is_flag=True, help="Pick a training worker at random.")
@click.option("--signal", "sig", type=click.Choice(["KILL", "STOP", "CONT", "TERM", "INT"]),
              default="KILL", show_default=True,
              help="STOP freezes the worker (the detector evicts it); CONT thaws it.")
@target_options
@token_option
def kill(
    member: str | None, pick_random: bool, sig: str, addresses: str | None, job: str | None,
    token_file: Path | None,
) -> None:  # fmt: skip
    """Send a signal to a worker: MEMBER (id, name or pid) or --random.

    Against the local `rollcall up` any of its workers; against a deployment
    (--rendezvous, --job) a member whose process runs on this machine.
    """
    if (member is None) == (not pick_random):
        raise click.UsageError("give either MEMBER or --random")
    if addresses or job:
        _kill_in_deployment(member, pick_random, sig, addresses, job, token_file)
        return
    from rollcall.local import control, find_local

    answer = asyncio.run(
        control(find_local(), {"op": "kill", "member": member, "signal": sig})
    )
    worker = answer["worker"]
    click.echo(f"sent SIG{sig} to {worker['member_id'] or worker['name']} (pid {worker['pid']})")


def _kill_in_deployment(
    member: str | None, pick_random: bool, sig: str, addresses: str | None, job: str | None,
    token_file: Path | None,
) -> None:  # fmt: skip
    import random

    from rollcall.local import DeploymentOperator

    replicas, job, token_file = resolve_target(addresses, job, token_file)
    operator = DeploymentOperator(replicas, job, token_file)
    local = {w["member_id"]: w for w in asyncio.run(operator.training())}
    if pick_random:
        if not local:
            fail(f"no member of job {job} runs on this machine")
        member = random.choice(sorted(local))
    assert member is not None
    if member not in local:
        fail(
            f"{member} is not a member of job {job} whose process runs on this machine: "
            "stop it where it runs (e.g. docker kill)"
        )
    asyncio.run(operator.signal(local[member], sig))
    click.echo(f"sent SIG{sig} to {member} (pid {local[member]['pid']})")


@main.command()
@click.option("--mtbf", type=click.FloatRange(min=0.1), required=True,
              help="Mean time between kills, seconds (exponentially distributed).")
@click.option("--duration", type=click.FloatRange(min=0.1, max=86400), required=True,
              help="Stop killing after this many seconds.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same schedule.")
@click.option("--rejoin-after", type=click.FloatRange(min=0), default=None,
              help="Start a replacement worker this many seconds after each kill.")
@click.option("--signal", "sig", type=click.Choice(["KILL", "STOP"]), default="KILL",
              show_default=True, help="STOP freezes instead (thawed when it is replaced).")
@click.option("--min-workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Never kill below this many training workers.")
@target_options
@token_option
@operator_options
def chaos(
    mtbf: float, duration: float, seed: int, rejoin_after: float | None, sig: str,
    min_workers: int, addresses: str | None, job: str | None, token_file: Path | None,
    host: str, log_dir: Path | None,
) -> None:  # fmt: skip
    """Kill random workers, reproducibly and for a bounded time, and
    optionally start replacements: in the local `rollcall up`, or (with
    --rendezvous and --job) among a deployment's members running on this
    machine, replacements starting here."""
    from rollcall.local import run_chaos

    operator = make_operator(addresses, job, token_file, host, log_dir)
    summary = asyncio.run(
        run_chaos(operator, mtbf, duration, seed, rejoin_after, sig, min_workers, click.echo)
    )
    click.echo(
        f"chaos: {summary['kills']} kills, {summary['rejoins']} rejoins in "
        f"{summary['seconds']:.1f} s (seed {seed})"
    )


@main.command()
@click.option("--rendezvous", "addresses", required=True, metavar="HOST:PORT[,...]",
              help="Rendezvous replica addresses.")
@click.option("--job", required=True, callback=check_job, help="Job name.")
@token_option
@click.option("--example", type=click.Choice(["lm"]), default="lm", show_default=True,
              help="Built-in job: a char-level transformer LM on the Python stdlib's source.")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Train until this many global steps are committed.")
@click.option("--global-batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--micro-batch", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--context", type=click.IntRange(min=2), default=64, show_default=True,
              help="Characters per sample.")
@click.option("--d-model", type=click.IntRange(min=4), default=64, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address peers reach this worker at (state transfer, process group).")
@click.option("--name", help="Prefix of the member id (default: $ROLLCALL_NAME, else w).")
@click.option("--ledger", type=click.Path(dir_okay=False, path_type=Path),
              help="Append the sample ids of every committed step to this JSON-lines file.")
@click.option("--digest-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Print the state digest every N committed steps (0: never).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write durable checkpoints here (storage every worker of the job can "
                   "read; default: $ROLLCALL_CHECKPOINT_DIR); the job resumes from the "
                   "newest when no live replica is left.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Write a checkpoint after every N-th committed step (with --checkpoint-dir).")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port at --host (0 picks a free one).")
@click.option("--min-workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="A job starting from step 0 waits until this many workers are in its view.")
@click.option("--start-over", is_flag=True,
              help="If the job has progress but no live worker and no checkpoint holds it, "
                   "start it again from step 0 (without this flag the worker exits with code 4).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line instead of text.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch intra-op threads.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="warning", show_default=True)
@config_option
def worker(
    addresses: str, job: str, token_file: Path | None, example: str, steps: int,
    global_batch: int, micro_batch: int, seed: int, context: int, d_model: int, layers: int,
    host: str, name: str | None, ledger: Path | None, digest_every: int,
    checkpoint_dir: Path | None, checkpoint_every: int, metrics_port: int | None,
    min_workers: int, start_over: bool, as_json: bool, threads: int, log_level: str,
    overrides: tuple[str, ...],
) -> None:  # fmt: skip
    """Run a training worker of the built-in example job.

    It joins the job, trains, survives other workers dying and arriving, and
    leaves cleanly when it reaches --steps or on Ctrl-C. If it is evicted (for
    example after being frozen past the failure detector's bound) it exits
    with code 3 and says so: its state is stale, start it again to rejoin.

    When no live replica is left and the job has durable checkpoints, it
    resumes from the newest usable one and prints the replay cost; if
    checkpoints exist but none can be loaded, or the job has progress but
    no checkpoint, it exits with code 4 rather than start the job from
    scratch (--start-over does that on purpose). SIGTERM or Ctrl-C leaves
    the job cleanly (exit 143 or 130); a second one exits at once.

    If its settings differ from the job's (global batch, micro batch, seed,
    model, optimizer...: docs/worker.md, "What must match across workers"),
    the job refuses it at join and it exits with code 5 and one line naming
    each differing field with both values. So it does too if its
    fence_window (--set) is not below the rendezvous service's earliest
    suspicion of a silent member, which the service sends at join.
    """
    from rollcall.protocol.wire import read_token

    config = parse_overrides(overrides)
    token = read_token(token_file)
    setup_logging(log_level)
    import torch

    from rollcall.membership.errors import (
        CannotResume,
        ConfigurationMismatch,
        Evicted,
        JobRecordLost,
        UnsafeFenceWindow,
    )
    from rollcall.worker.examples.lm import LMConfig, build, loss_sum
    from rollcall.worker.runtime import Elastic
    from rollcall.worker.state import capture, digest

    torch.set_num_threads(threads)
    lm_config = LMConfig(context=context, d_model=d_model, layers=layers)
    model, optimizer, corpus = build(lm_config, seed)

    def say(**record: Any) -> None:
        # Flushed per line: a supervisor reading a pipe sees each step as it
        # commits, and a frozen worker holds back nothing already done.
        if as_json:
            click.echo(json.dumps(record))
        elif record["event"] == "step":
            click.echo(
                f"step {record['step']:>6}  loss {record['loss']:.4f}  epoch {record['epoch']}"
                f"  rank {record['rank']}/{record['world']}  samples/s {record['samples_s']:.1f}"
                + (f"  {record['digest'][:19]}" if "digest" in record else "")
            )
        else:
            click.echo(" ".join(f"{k}={v}" for k, v in record.items()))
        sys.stdout.flush()

    try:
        with Elastic(
            model, optimizer, corpus, global_batch=global_batch, micro_batch=micro_batch,
            seed=seed, rendezvous=split_list(addresses), job=job, token=token, host=host,
            name=name, ledger=ledger, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, metrics_port=metrics_port, config=config,
            min_workers=min_workers, start_over=start_over,
        ) as elastic:  # fmt: skip
            say(event="joined", member_id=elastic.member_id, pid=os.getpid(),
                address=elastic.address)  # fmt: skip
            last = time.perf_counter()
            resumed_said = False
            for step in elastic.steps(steps):
                if elastic.resumed is not None and not resumed_said:
                    resumed_said = True
                    say(event="resumed", **elastic.resumed.to_dict())
                for batch in step.microbatches():
                    loss, count = loss_sum(model, batch.inputs, batch.targets)
                    step.backward(loss, count)
                if not step.commit():
                    say(event="aborted", step=step.number, epoch=step.epoch)
                    continue
                now = time.perf_counter()
                record: dict[str, Any] = {
                    "event": "step", "step": step.number, "loss": step.loss,
                    "epoch": step.epoch, "rank": step.rank, "world": step.world_size,
                    "samples_s": global_batch / max(now - last, 1e-9),
                }  # fmt: skip
                last = now
                if digest_every and step.number % digest_every == 0:
                    record["digest"] = digest(capture(step.number, model, optimizer))
                say(**record)
            say(event="done", step=elastic.committed_step)
    except Evicted as exc:
        fail(f"evicted from job {job}: {exc}; this worker's state is stale, start it again", 3)
    except CannotResume as exc:
        fail(f"job {job} cannot resume: {exc}", 4)
    except JobRecordLost as exc:
        fail(f"job {job}: {exc}", EXIT_RECORD_LOST)
    except UnsafeFenceWindow as exc:
        fail(f"left job {job} at once: {exc}", EXIT_MISMATCH)
    except ConfigurationMismatch as exc:
        fail(f"job {job} refused this worker: {exc}", EXIT_MISMATCH)


def _register_report() -> None:
    from rollcall.report import report

    main.add_command(report)


_register_report()


def _register_checkpoints() -> None:
    from rollcall.checkpoints import build

    main.add_command(build(resolve_target, target_options, token_option))


_register_checkpoints()


if __name__ == "__main__":
    main()
