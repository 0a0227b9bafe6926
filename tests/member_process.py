"""A lightweight member as its own process, for tests that kill or freeze it.

    python -m tests.member_process --rendezvous A[,B] --job J [--address HOST:PORT]
        [--agent ADDRESS]

Reads the token from $ROLLCALL_TOKEN. Prints one JSON object per line on
stdout: {"event": "joined", "member_id": ..., "secret": ...} (its member
secret, so that a test may speak for it), {"event": "view", "epoch": N,
"members": [...]}, {"event": "ended", "error": ...}, {"event": "left"}.
Answers roll calls with its last reported step. On SIGTERM it leaves cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys

from rollcall.membership.config import Config
from rollcall.membership.errors import RollcallError
from rollcall.membership.view import View
from rollcall.protocol.client import RendezvousClient


def emit(**record: object) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> int:
    client = RendezvousClient(
        args.rendezvous.split(","), args.job, os.environ["ROLLCALL_TOKEN"], Config(),
        agent=args.agent,
    )  # fmt: skip

    def on_view(view: View) -> None:
        emit(event="view", epoch=view.epoch, members=list(view.ids))

    member_id = await client.join(args.address, name=args.name, on_view=on_view)
    emit(event="joined", member_id=member_id, secret=client._member_secret)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    step = 0
    while not stop.is_set():
        if client.ended is not None:
            emit(event="ended", error=type(client.ended).__name__, message=str(client.ended))
            await client.close()
            return 3
        if member_id in client.view and args.progress:
            step += 1
            client.report_progress(step)
        with contextlib.suppress(TimeoutError):  # no stop yet: report again
            await asyncio.wait_for(stop.wait(), 0.1)
    try:
        await client.leave()
        emit(event="left")
    except RollcallError as exc:
        emit(event="leave-failed", error=type(exc).__name__, message=str(exc))
    await client.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--address", default="127.0.0.1:1")
    parser.add_argument("--name", default="p")
    parser.add_argument("--progress", action="store_true", help="report a step every 0.1 s")
    parser.add_argument("--agent", default=None, help="a host agent carrying its session")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
