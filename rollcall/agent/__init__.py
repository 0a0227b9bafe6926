"""The host agent (``rollcall agent``): the session streams of one host's
workers carried to the leader on one shared stream (docs/protocol.md,
"Shared sessions").

- ``relay``: a worker's session as the agent relays it (``RelayedMember``)
  and the gRPC ``Session`` the workers open on the agent (``HostAgent``);
- ``server``: the agent's gRPC server on a Unix socket or a loopback port.
"""
