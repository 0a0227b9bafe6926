"""Names of the environment variables through which a supervisor (``rollcall
up``) tells a training process where its job is.

The runtime reads them when its constructor is not told; ``rollcall up``
sets them for every copy of the command it starts. Kept apart from
``worker/runtime.py`` so that the supervisor can name them without importing
torch. The token's variables are in ``rollcall/protocol/wire.py`` (``read_token``).
"""

from __future__ import annotations

#: Rendezvous replica addresses, ``HOST:PORT[,HOST:PORT...]``.
ENV_RENDEZVOUS = "ROLLCALL_RENDEZVOUS"
#: The host agent that carries this host's sessions (``rollcall agent``):
#: ``unix:PATH`` or a loopback ``HOST:PORT``.
ENV_AGENT = "ROLLCALL_AGENT"
#: The job's name.
ENV_JOB = "ROLLCALL_JOB"
#: Prefix of the member id (``w0`` -> ``w0-1a2b3c4d``).
ENV_NAME = "ROLLCALL_NAME"
#: Directory for durable checkpoints, shared by the job's workers.
ENV_CHECKPOINT_DIR = "ROLLCALL_CHECKPOINT_DIR"
#: File descriptor of the supervisor's report socket (``worker/report.py``).
ENV_REPORT_FD = "ROLLCALL_REPORT_FD"

#: Member-id prefix when neither ``name=`` nor ``$ROLLCALL_NAME`` says one.
DEFAULT_NAME = "w"
