"""What both sides of the rendezvous protocol share: the wire (messages <->
protobuf, the token, channels), validation of what arrives, the member's
client, and metrics serving. It sits below the service (``rollcall.rendezvous``)
and the worker (``rollcall.worker``), which never import each other.
"""
