"""``rollcall etcd``, ``rollcall etcd-auth``, ``rollcall rendezvous`` and
``rollcall agent``: the control plane's processes, and etcd's
authentication."""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path
from typing import Any

import click

from rollcall.cli.options import (
    check_job,
    config_option,
    log_level_option,
    parse_overrides,
    setup_logging,
    split_list,
    token_option,
)


@click.command()
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
        f'--user {credentials.user}:"$(cat {password})" get --prefix /rollcall/'
    )


@click.command("etcd-auth")
@click.option(
    "--etcd",
    "etcd_urls",
    required=True,
    metavar="URL[,URL...]",
    help="etcd endpoints (plain http), e.g. http://127.0.0.1:2379.",
)
@click.option(
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the passwords are kept (created with mode 0700; files 0600).",
)
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


@click.command()
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
@log_level_option("info")
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


def private_workdir(data_dir: Path | None, what: str = "--data-dir") -> Path:
    """`up`'s work directory (the token, the control socket, checkpoints,
    logs), open to this user only: a new temporary one, or ``data_dir``,
    created 0700 if new and refused if another user owns it or others may
    enter it (``rollcall.private``)."""
    if data_dir is None:
        return Path(tempfile.mkdtemp(prefix="rollcall-up-"))  # mkdtemp makes it 0700
    from rollcall.private import private_directory

    return private_directory(data_dir, what)


@click.command()
@click.option(
    "--rendezvous",
    "addresses",
    required=True,
    metavar="HOST:PORT[,HOST:PORT...]",
    help="The rendezvous replicas.",
)
@click.option("--job", required=True, callback=check_job, help="The job whose sessions it carries.")
@click.option(
    "--listen",
    required=True,
    metavar="unix:PATH | HOST:PORT",
    help="Where this host's workers reach it: a Unix socket, or a loopback address (no TLS: "
    "nothing beyond this host).",
)
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
@log_level_option("info")
@config_option
def agent(
    addresses: str,
    job: str,
    listen: str,
    token_file: Path | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    log_level: str,
    overrides: tuple[str, ...],
) -> None:
    """Carry this host's workers' sessions to the leader on one stream.

    Workers told its address (`rollcall worker --agent`, `Elastic(agent=...)`,
    $ROLLCALL_AGENT) open their sessions here; the leader then takes one
    stream and one heartbeat per interval from the host instead of one per
    worker (docs/protocol.md, "Shared sessions"). If the agent is gone or
    cannot reach the leader, the workers' sessions go to the replicas
    directly."""
    from rollcall.agent.server import AgentOptions, serve_until_signalled
    from rollcall.membership.errors import InvalidRequest
    from rollcall.protocol.client import ClientTLS
    from rollcall.protocol.wire import read_token

    config = parse_overrides(overrides)
    if (tls_cert or tls_key) and not tls_ca:
        raise click.UsageError("--tls-cert/--tls-key need --tls-ca")
    options = AgentOptions(
        rendezvous=split_list(addresses),
        job=job,
        token=read_token(token_file),
        listen=listen,
        config=config,
        tls=ClientTLS(tls_ca, tls_cert, tls_key) if tls_ca else None,
    )
    setup_logging(log_level)
    try:
        asyncio.run(serve_until_signalled(options, ready="agent ready at {address}"))
    except InvalidRequest as error:
        raise click.UsageError(str(error)) from None
