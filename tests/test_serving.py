"""Serving metrics (rollcall.protocol.serving): a port another process or
server holds is one clear error naming it and what to do."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from rollcall.membership.errors import UsageError
from rollcall.protocol.serving import serve, stop


def test_a_metrics_port_in_use_is_refused_with_what_to_do() -> None:
    # Two workers of one host given the same metrics_port: at 57a2593 the
    # second failed with prometheus_client's bare OSError traceback.
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(UsageError, match=rf"metrics at 127.0.0.1:{port}: .*port of its own"):
            serve(CollectorRegistry(), port, "127.0.0.1")
    finally:
        holder.close()
    server = serve(CollectorRegistry(), port, "127.0.0.1")  # free again: served
    stop(server)
