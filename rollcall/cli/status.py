"""``rollcall status``: a job's current view, leader and last committed step."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

import click

from rollcall.cli.options import local_target, resolve_target, target_options, token_option
from rollcall.membership.config import Config


@click.command()
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
                    "lost_epoch": result.lost_epoch or None,
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
    if result.lost_epoch:
        click.echo(
            f"warning: etcd lost this job's data while it trained (a worker was at epoch "
            f"{result.lost_epoch}); workers resume only from checkpoint files or --start-over"
        )
    stuck = durability_line(result.durability)
    if stuck is not None:
        click.echo(f"warning: {stuck}")
