"""The ``rollcall`` command line: the ``main`` group, assembled from the
modules here by concern.

- ``group``: every expected error as one line on stderr, and the exit codes;
- ``options``: flags several commands share, and where a command goes;
- ``control_plane``: ``etcd``, ``etcd-auth``, ``rendezvous``, ``agent``;
- ``status``; ``up`` (a local cluster); ``operate``: ``add``, ``kill``,
  ``chaos``; ``worker`` (the built-in example job);
- ``plan`` (a job's detector timeout and checkpoint interval, from the
  simulator in ``rollcall.planning``);
- ``rollcall.report.command`` (``report``) and ``rollcall.checkpoints``
  (``checkpoints``).

Heavy imports happen inside the commands, so ``--help`` and argument errors
are instant.
"""

from __future__ import annotations

import signal

import click

from rollcall.checkpoints import build as build_checkpoints
from rollcall.cli.control_plane import agent, etcd, etcd_auth, rendezvous
from rollcall.cli.group import RollcallGroup
from rollcall.cli.operate import add, chaos, kill
from rollcall.cli.options import resolve_target, target_options, token_option
from rollcall.cli.plan import plan
from rollcall.cli.status import status
from rollcall.cli.up import up
from rollcall.cli.worker import worker
from rollcall.report.command import report


@click.group(cls=RollcallGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torch-rollcall")
def main() -> None:
    """rollcall: keep-alive membership for elastic PyTorch training."""
    # A program started in the background of a non-interactive shell
    # inherits SIGINT ignored; every rollcall command stops on Ctrl-C.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


for _command in (
    etcd, etcd_auth, rendezvous, agent, status, up, add, kill, chaos, worker, report, plan
):
    main.add_command(_command)
main.add_command(build_checkpoints(resolve_target, target_options, token_option))
