"""What the service, the host agent and the workers share about serving:
metrics (each process keeps its own registry, no global state, served over
HTTP by ``prometheus_client``; names in docs/events.md, "Metrics"), and
waiting for the signal that stops a server process.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from rollcall.membership.errors import UsageError

#: Stall buckets, seconds: a view change takes milliseconds to seconds.
STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10, 30)
PHASES = ("detect_s", "rollcall_s", "fetch_s", "rebuild_s", "first_step_s")


def serve(registry: CollectorRegistry, port: int, host: str) -> Any:
    """Serve ``registry`` at ``http://host:port/metrics``; returns the server.
    A port that cannot be had (another process of the host serves on it) is
    a :class:`UsageError` naming it."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise UsageError(
            f"cannot serve metrics at {host}:{port}: {exc.strerror or exc}. Another process of "
            "this host (another worker given the same metrics port?) may have it: give each "
            "process a port of its own"
        ) from None
    return server


def stop(server: Any) -> None:
    """Stop a server from :func:`serve` (None: nothing to stop)."""
    if server is not None:
        server.shutdown()
        server.server_close()


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM (a server process's stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
