"""Start a rendezvous replica: gRPC server, token check, TLS, etcd store."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rollcall.membership.config import Config
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.serving import serve, until_signalled
from rollcall.protocol.serving import stop as stop_metrics
from rollcall.protocol.validation import check_address, check_id
from rollcall.protocol.wire import TRANSPORT_LIMIT, TokenInterceptor
from rollcall.rendezvous.etcd_auth import EtcdCredentials
from rollcall.rendezvous.etcd_client import EtcdClientTLS
from rollcall.rendezvous.events import EventFile
from rollcall.rendezvous.metrics import ServiceMetrics
from rollcall.rendezvous.service import Replica
from rollcall.rendezvous.store import EtcdStore

log = logging.getLogger("rollcall.rendezvous")


@dataclass(frozen=True)
class ServerTLS:
    """The service's certificate and key; with ``client_ca_file`` the service
    also requires client certificates signed by that CA."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        client_ca = read(self.client_ca_file) if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(read(self.key_file), read(self.cert_file))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True)
class ReplicaOptions:
    etcd: Sequence[str]
    job: str
    listen: str
    token: str
    advertise: str | None = None
    config: Config = Config()
    tls: ServerTLS | None = None
    etcd_tls: EtcdClientTLS | None = None
    #: etcd user and password (None: etcd without authentication).
    etcd_auth: EtcdCredentials | None = None
    #: Append view-change events (docs/events.md) to this file.
    events: Path | None = None
    #: Serve Prometheus metrics on this port (0: a free one; None: no metrics).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


def default_advertise(listen: str, port: int) -> str:
    host = listen.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


class RunningReplica:
    """A started replica; ``address`` is what it advertises."""

    def __init__(
        self,
        server: grpc.aio.Server,
        replica: Replica,
        store: EtcdStore,
        address: str,
        events: EventFile | None = None,
        metrics_server: Any = None,
    ):
        self.server = server
        self.replica = replica
        self.address = address
        self._store = store
        self._events = events
        self._metrics_server = metrics_server
        #: ``host:port`` of the metrics endpoint, if any.
        self.metrics_address = (
            f"{metrics_server.server_address[0]}:{metrics_server.server_address[1]}"
            if metrics_server is not None
            else None
        )

    async def stop(self, grace: float = 1.0) -> None:
        await self.replica.stop()
        await self.server.stop(grace)
        self._store.close()
        if self._events is not None:
            self._events.close()
        stop_metrics(self._metrics_server)


async def start_replica(options: ReplicaOptions) -> RunningReplica:
    """Connect to etcd (failing fast with ``ControlPlaneUnavailable``), bind
    the port and start campaigning."""
    config = options.config
    check_id(options.job, "job", config)
    check_address(options.listen, config, listen=True)
    store = EtcdStore(options.etcd, options.job, config, options.etcd_tls, options.etcd_auth)
    try:
        await asyncio.get_running_loop().run_in_executor(None, store.ping)
        server = grpc.aio.server(
            # The interceptor refuses requests above max_message_bytes; gRPC's
            # own limit only stops what is too large to buffer.
            interceptors=[TokenInterceptor(options.token, config.max_message_bytes)],
            options=[
                ("grpc.max_receive_message_length", TRANSPORT_LIMIT),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            if options.tls is not None:
                port = server.add_secure_port(options.listen, options.tls.credentials())
            else:
                port = server.add_insecure_port(options.listen)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {options.listen} (address in use or not local?)")
    except BaseException:
        store.close()
        raise
    advertise = options.advertise or default_advertise(options.listen, port)
    events = EventFile(options.events) if options.events is not None else None
    metrics = ServiceMetrics() if options.metrics_port is not None else None
    metrics_server = (
        serve(metrics.registry, options.metrics_port, options.metrics_host)
        if metrics is not None and options.metrics_port is not None
        else None
    )
    replica = Replica(store, options.job, advertise, config, events=events, metrics=metrics)
    pb_grpc.add_RendezvousServicer_to_server(replica, server)
    await server.start()
    await replica.start()
    log.info("rendezvous replica for job %s listening on %s", options.job, advertise)
    running = RunningReplica(server, replica, store, advertise, events, metrics_server)
    if running.metrics_address:
        log.info("metrics at http://%s/metrics", running.metrics_address)
    return running


async def serve_until_signalled(options: ReplicaOptions, ready: str | None = None) -> None:
    """Run a replica until SIGINT or SIGTERM, then step down cleanly."""
    running = await start_replica(options)
    if ready is not None:
        print(ready.format(address=running.address), flush=True)
    try:
        await until_signalled()
    finally:
        await running.stop()
