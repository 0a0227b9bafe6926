"""The ``rollcall`` command group's handling of errors: every failure the
user can cause or meet (a bad flag, etcd unreachable, a wrong token, no
such job) ends as one line on stderr and a non-zero exit, never a
traceback; and the exit codes."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from rollcall.membership.errors import RollcallError

#: Exit codes: 1 for a runtime failure, 2 for bad usage (as click does).
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: ``rollcall worker``: its settings differ from its job's (ConfigurationMismatch).
EXIT_MISMATCH = 5
#: ``rollcall worker``: etcd lost the job's data and no replica remembered it
#: (JobRecordLost): the worker cannot rejoin under its old id.
EXIT_RECORD_LOST = 6
#: ``rollcall worker``: a step's reduced gradient was not finite
#: (NonFiniteGradient): started again as it was, the run meets it again.
EXIT_NOT_FINITE = 7


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
            hint = f" (see '{_command_path(exc.ctx)} --help')" if exc.ctx else ""
            fail(f"{exc.format_message()}{hint}", EXIT_USAGE)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code or EXIT_FAILURE)
        except RollcallError as exc:
            fail(str(exc))
        except (OSError, ValueError) as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            sys.exit(130)


def _command_path(ctx: click.Context) -> str:
    """The command as typed after the program's name, which is 'rollcall'
    however it was started (``python -m rollcall.cli`` included)."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(["rollcall", *reversed(names)])
