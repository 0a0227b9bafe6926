"""Whether a member's process is alive, asked of the process itself.

A new leader inherits the view's members without their sessions. One that
does not reconnect within the takeover grace is dead, or alive and still
held by the previous leader (cut off from etcd, that one keeps its sessions
until it reaches etcd again). Only the member can tell: any gRPC answer from
its state server, even a refusal of the unauthenticated question, proves
that its process runs and is reachable; no answer within the timeout (a
refused connection, a frozen or vanished process) does not.
"""

from __future__ import annotations

import grpc

from rollcall.pb import state_pb2, state_pb2_grpc

__all__ = ["process_answers"]

#: Codes that mean "nothing answered", as opposed to "something refused".
_SILENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


async def process_answers(address: str, timeout: float) -> bool:
    """Whether a gRPC server answers at ``address`` within ``timeout`` s."""
    try:
        channel = grpc.aio.insecure_channel(address)
    except (ValueError, RuntimeError):
        return False
    try:
        stub = state_pb2_grpc.StateTransferStub(channel)
        await stub.Describe(state_pb2.StateRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc.code() not in _SILENT
    finally:
        await channel.close()
    return True
