"""``rollcall add``, ``rollcall kill`` and ``rollcall chaos``: operating the
workers of the local ``rollcall up``, or of a deployment from this machine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from rollcall.cli.group import fail
from rollcall.cli.options import F, resolve_target, target_options, token_option


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


@click.command()
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


@click.command()
@click.argument("member", required=False)
@click.option("--random", "pick_random", is_flag=True, help="Pick a training worker at random.")
@click.option(
    "--signal",
    "sig",
    type=click.Choice(["KILL", "STOP", "CONT", "TERM", "INT"]),
    default="KILL",
    show_default=True,
    help="STOP freezes the worker (the detector evicts it); CONT thaws it.",
)
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

    answer = asyncio.run(control(find_local(), {"op": "kill", "member": member, "signal": sig}))
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


@click.command()
@click.option(
    "--mtbf",
    type=click.FloatRange(min=0.1),
    required=True,
    help="Mean time between kills, seconds (exponentially distributed).",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0.1, max=86400),
    required=True,
    help="Stop killing after this many seconds.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same schedule.")
@click.option(
    "--rejoin-after",
    type=click.FloatRange(min=0),
    default=None,
    help="Start a replacement worker this many seconds after each kill.",
)
@click.option(
    "--signal",
    "sig",
    type=click.Choice(["KILL", "STOP"]),
    default="KILL",
    show_default=True,
    help="STOP freezes instead (thawed when it is replaced).",
)
@click.option(
    "--min-workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Never kill below this many training workers.",
)
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
