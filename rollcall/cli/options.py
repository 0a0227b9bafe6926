"""Flags that several commands share, and what they resolve to: ``--set``
into a ``Config``, ``--token-file``, ``--job`` checked, and where a command
goes (``--rendezvous`` and ``--job``, or the local ``rollcall up``)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from rollcall.membership.config import Config

F = TypeVar("F", bound=Callable[..., Any])


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


def log_level_option(default: str) -> Callable[[F], F]:
    """``--log-level``, defaulting to ``default``."""
    return click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default=default,
        show_default=True,
    )


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
