"""What the runtime tells a person: a default log handler and the words of
its messages.

A library user who never configures ``logging`` would otherwise see nothing
(Python drops INFO records and shows WARNING ones bare). So ``Elastic``
attaches one handler to the ``rollcall`` logger that prints INFO and above
as ``rollcall: <message>`` on stderr, unless logging was already configured
(the root logger has handlers) or ``messages=False``. If the program
configures logging later, the handler steps aside: records then go to the
root logger's handlers, filtered by its level, as if rollcall had never
printed anything itself.

The texts name members and causes and never pass on gloo's raw transport
text ("[pair.cc:553] Connection closed by peer ... GLHF!"), which stays at
DEBUG.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from rollcall.membership.cause import Cause, CauseKind
from rollcall.membership.view import View

__all__ = ["describe_transport", "install_default_handler", "view_change"]

LOGGER = "rollcall"


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints rollcall's records while nothing else is configured."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("rollcall: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        if root.handlers:  # configured after us: behave as if propagating
            if record.levelno >= root.getEffectiveLevel():
                for handler in root.handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)
            return
        super().emit(record)


def install_default_handler() -> None:
    """Print rollcall's INFO and above on stderr if logging is unconfigured.
    Idempotent; does nothing when the root logger already has handlers."""
    logger = logging.getLogger(LOGGER)
    if logging.getLogger().handlers or any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    logger.addHandler(_DefaultHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


def describe_transport(text: str) -> str:
    """gloo's or the store's failure text, in a few words."""
    lowered = text.lower()
    if "connection reset" in lowered:
        return "a peer reset its connection (it crashed or was killed)"
    if "connection closed" in lowered:
        return "a peer closed its connection (it crashed, left or gave up)"
    if "timed out" in lowered or "timeout" in lowered:
        return "a peer did not answer in time"
    if "connection refused" in lowered or "does not accept" in lowered:
        return "a peer's address refused the connection"
    if "did not join" in lowered:
        return text
    return text.splitlines()[0][:160] if text else "unknown transport error"


def _who(member_id: str, causes: Sequence[Cause]) -> str:
    """How ``member_id`` left, from the roll call's causes."""
    for cause in causes:
        if cause.member_id != member_id:
            continue
        if cause.kind is CauseKind.LEAVE:
            return "left"
        if cause.kind is CauseKind.REPORT:
            return f"lost (reported failing by {cause.reporter})"
    return "lost"


def view_change(
    previous: View | None,
    view: View,
    rank: int,
    causes: Sequence[Cause],
    me: str,
) -> str:
    """One line for a view this worker enters, e.g. "view 5: 3 members
    (w2-3e36 lost, w4-1a2b joined); rank 1, step 217 next"."""
    old = previous.ids if previous is not None else ()
    before = set(old)
    changes = [f"{m} {_who(m, causes)}" for m in old if m not in view]
    changes += [f"{m} joined" for m in view.ids if m not in before and m != me]
    detail = f" ({', '.join(changes)})" if changes else ""
    where = "step 0 next" if view.resume_step is None else f"step {view.resume_step + 1} next"
    members = "member" if view.size == 1 else "members"
    return f"view {view.epoch}: {view.size} {members}{detail}; rank {rank}, {where}"
