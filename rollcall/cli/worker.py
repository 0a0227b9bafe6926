"""``rollcall worker``: a training worker of the built-in example job (its
loop is ``rollcall.worker.examples.lm_loop``); how it prints what happens,
and the exit code each way out of the job has."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from rollcall.cli.group import EXIT_MISMATCH, EXIT_NOT_FINITE, EXIT_RECORD_LOST, fail
from rollcall.cli.options import (
    check_job,
    config_option,
    log_level_option,
    parse_overrides,
    setup_logging,
    split_list,
    token_option,
)
from rollcall.worker.environment import DEFAULT_NAME, ENV_JOB, ENV_NAME, ENV_RENDEZVOUS


@click.command()
@click.option(
    "--rendezvous",
    "addresses",
    required=True,
    envvar=ENV_RENDEZVOUS,
    metavar="HOST:PORT[,...]",
    help=f"Rendezvous replica addresses (default: ${ENV_RENDEZVOUS}, which `rollcall up` sets).",
)
@click.option(
    "--agent",
    metavar="unix:PATH | HOST:PORT",
    help="The host agent that carries this host's sessions (rollcall agent; default "
    "$ROLLCALL_AGENT); without one, or when it does not answer, the session goes to the "
    "replicas directly.",
)
@click.option(
    "--job",
    required=True,
    envvar=ENV_JOB,
    callback=check_job,
    help=f"Job name (default: ${ENV_JOB}, which `rollcall up` sets).",
)
@token_option
@click.option(
    "--example",
    type=click.Choice(["lm"]),
    default="lm",
    show_default=True,
    help="Built-in job: a char-level transformer LM on the Python stdlib's source.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Train until this many global steps are committed.",
)
@click.option("--global-batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--micro-batch", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--context",
    type=click.IntRange(min=2),
    default=64,
    show_default=True,
    help="Characters per sample.",
)
@click.option("--d-model", type=click.IntRange(min=4), default=64, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address peers reach this worker at (state transfer, process group).",
)
@click.option("--name", help="Prefix of the member id (default: $ROLLCALL_NAME, else w).")
@click.option(
    "--ledger",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append the sample ids of every committed step to this JSON-lines file, one per "
    "worker (a file another worker writes is refused); {name} in it becomes the worker's "
    "name (--name, else $ROLLCALL_NAME, which `rollcall up` and `rollcall add` set: w0, w1, ...).",
)
@click.option(
    "--digest-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Print the state digest every N committed steps (0: never).",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write durable checkpoints here (storage every worker of the job can "
    "read; default: $ROLLCALL_CHECKPOINT_DIR); the job resumes from the "
    "newest when no live replica is left.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Write a checkpoint after every N-th committed step (with --checkpoint-dir).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port at --host (0 picks a free one).",
)
@click.option(
    "--min-workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="A job starting from step 0 waits until this many workers are in its view.",
)
@click.option(
    "--start-over",
    is_flag=True,
    help="If the job has progress but no live worker and no checkpoint holds it, "
    "start it again from step 0 (without this flag the worker exits with code 4).",
)
@click.option(
    "--exact",
    is_flag=True,
    help="Bit-exact mode: every step's update depends on its samples alone, whatever the "
    "world size or membership history (docs/exactness.md). Every worker of a job must agree.",
)
@click.option(
    "--overlap",
    is_flag=True,
    help="Reduce the gradients bucket by bucket while the last backward pass of a step runs "
    "(docs/worker.md, \"Overlapped reduction\"); not with --exact. Every worker of a job must "
    "agree.",
)
@click.option(
    "--shard-redundancy",
    type=click.IntRange(min=1),
    default=None,
    help="Shard the optimizer state: each partition is kept by this many workers, so a worker "
    "holds about redundancy/world of it (docs/sharding.md). Off by default (every worker "
    "holds all of it). Every worker of a job must agree.",
)
@click.option(
    "--shard-partitions",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="With --shard-redundancy: partitions of the optimizer state, fixed for the job.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line instead of text.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch intra-op threads.",
)
@log_level_option("warning")
@config_option
def worker(
    addresses: str, agent: str | None, job: str, token_file: Path | None, example: str, steps: int,
    global_batch: int, micro_batch: int, seed: int, context: int, d_model: int, layers: int,
    host: str, name: str | None, ledger: Path | None, digest_every: int,
    checkpoint_dir: Path | None, checkpoint_every: int, metrics_port: int | None,
    min_workers: int, start_over: bool, exact: bool, overlap: bool, shard_redundancy: int | None,
    shard_partitions: int, as_json: bool, threads: int, log_level: str, overrides: tuple[str, ...],
) -> None:  # fmt: skip
    """Run a training worker of the built-in example job.

    It joins the job, trains, survives other workers dying and arriving, and
    leaves cleanly when it reaches --steps or on Ctrl-C. If it is evicted (for
    example after being frozen past the failure detector's bound) it exits
    with code 3 and says so: its state is stale, start it again to rejoin. So
    it does if its copy of a partition of a sharded optimizer state is
    found to differ from the copy another worker computed (the workers do
    not compute alike).

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
    suspicion of a silent member, its rollcall_step_end_wait is above the
    service's, or its fence_patience is shorter than a failover of the
    service's leader; the service sends what it needs at join.

    If a step's reduced gradient holds NaN or infinity (a diverged run),
    every worker stops at that step before applying it and exits with
    code 7: the job's state stays that of the step before.
    """
    from rollcall.protocol.wire import read_token

    config = parse_overrides(overrides)
    token = read_token(token_file)
    setup_logging(log_level)
    from rollcall.membership.errors import (
        CannotResume,
        ConfigurationMismatch,
        Evicted,
        JobRecordLost,
        NonFiniteGradient,
        StateDrifted,
        UnsafeTiming,
    )
    from rollcall.worker.startup import import_torch

    import_torch()
    from rollcall.worker.examples.lm import LMConfig
    from rollcall.worker.examples.lm_loop import LMRun, train

    run = LMRun(
        steps=steps, global_batch=global_batch, micro_batch=micro_batch, seed=seed,
        model=LMConfig(context=context, d_model=d_model, layers=layers),
        digest_every=digest_every, threads=threads,
    )  # fmt: skip

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

    if ledger is not None:
        ledger = ledger_path(ledger, name)
    try:
        train(
            run, say, rendezvous=split_list(addresses), agent=agent, job=job, token=token,
            host=host,
            name=name, ledger=ledger, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, metrics_port=metrics_port, config=config,
            min_workers=min_workers, start_over=start_over, exact=exact, overlap=overlap,
            shard_redundancy=shard_redundancy, shard_partitions=shard_partitions,
        )  # fmt: skip
    except Evicted as exc:
        fail(f"evicted from job {job}: {exc}; this worker's state is stale, start it again", 3)
    except StateDrifted as exc:
        fail(f"left job {job}: {exc}", 3)
    except NonFiniteGradient as exc:
        fail(f"left job {job}: {exc}", EXIT_NOT_FINITE)
    except CannotResume as exc:
        fail(f"job {job} cannot resume: {exc}", 4)
    except JobRecordLost as exc:
        fail(f"job {job}: {exc}", EXIT_RECORD_LOST)
    except UnsafeTiming as exc:
        fail(f"left job {job} at once: {exc}", EXIT_MISMATCH)
    except ConfigurationMismatch as exc:
        fail(f"job {job} refused this worker: {exc}", EXIT_MISMATCH)


def ledger_path(ledger: Path, name: str | None) -> Path:
    """``--ledger`` with ``{name}`` replaced by the worker's name: each
    worker started from one command line gets a file of its own."""
    worker_name = name or os.environ.get(ENV_NAME) or DEFAULT_NAME
    return Path(str(ledger).replace("{name}", worker_name))
