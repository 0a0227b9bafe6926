"""Start a host agent: its gRPC server for the host's workers and its
shared stream to the rendezvous service."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from rollcall.agent.relay import HostAgent
from rollcall.membership.config import Config
from rollcall.membership.errors import InvalidRequest
from rollcall.pb import rendezvous_pb2_grpc as pb_grpc
from rollcall.protocol.carrier import SessionCarrier
from rollcall.protocol.client import ClientTLS
from rollcall.protocol.serving import until_signalled
from rollcall.protocol.validation import check_address, check_id
from rollcall.protocol.wire import TRANSPORT_LIMIT, TokenInterceptor

log = logging.getLogger("rollcall.agent")

UNIX_PREFIX = "unix:"


@dataclass(frozen=True)
class AgentOptions:
    rendezvous: Sequence[str]
    job: str
    token: str
    #: ``unix:PATH`` (the default place) or a loopback ``HOST:PORT``: the
    #: workers' sessions reach the agent without TLS, so never beyond the host.
    listen: str
    config: Config = Config()
    tls: ClientTLS | None = None


def check_listen(listen: str, config: Config) -> str:
    """``unix:PATH``, or ``HOST:PORT`` on a loopback address: the agent
    serves its host's workers only (without TLS)."""
    if listen.startswith(UNIX_PREFIX):
        if not listen[len(UNIX_PREFIX) :].strip("/"):
            raise InvalidRequest(f"--listen {listen!r} names no socket path")
        return listen
    check_address(listen, config, listen=True)
    host = listen.rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidRequest(
            f"--listen {listen!r} is not on this host only: the agent serves its host's workers "
            "without TLS, so it listens on a Unix socket (unix:PATH) or a loopback address"
        )
    return listen


class RunningAgent:
    def __init__(self, server: grpc.aio.Server, agent: HostAgent, address: str) -> None:
        self.server, self.agent, self.address = server, agent, address

    async def stop(self, grace: float = 1.0) -> None:
        await self.agent.stop()
        await self.server.stop(grace)


async def start_agent(options: AgentOptions) -> RunningAgent:
    config = options.config
    check_id(options.job, "job", config)
    listen = check_listen(options.listen, config)
    carrier = SessionCarrier(
        list(options.rendezvous), options.job, options.token, config, options.tls, relayed=True
    )
    agent = HostAgent(carrier, options.job, config)
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(options.token, config.max_message_bytes)],
        options=[("grpc.max_receive_message_length", TRANSPORT_LIMIT), ("grpc.so_reuseport", 0)],
    )
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0 and not listen.startswith(UNIX_PREFIX):
        raise OSError(f"cannot listen on {listen} (address in use?)")
    pb_grpc.add_RendezvousServicer_to_server(agent, server)
    await server.start()
    if listen.startswith(UNIX_PREFIX):
        path = listen[len(UNIX_PREFIX) :]
        if not os.path.exists(path):
            raise OSError(f"cannot listen on {listen}")
        os.chmod(path, 0o600)  # this user's workers only (the token is checked too)
        address = listen
    else:
        address = f"{listen.rpartition(':')[0]}:{port}"
    agent.start()
    log.info("host agent for job %s listening on %s", options.job, address)
    return RunningAgent(server, agent, address)


async def serve_until_signalled(options: AgentOptions, ready: str | None = None) -> None:
    """Run an agent until SIGINT or SIGTERM."""
    running = await start_agent(options)
    if ready is not None:
        print(ready.format(address=running.address), flush=True)
    try:
        await until_signalled()
    finally:
        await running.stop()
