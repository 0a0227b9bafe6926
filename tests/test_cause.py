"""A roll call's causes travel as text (``str(Cause)``) and are read back
by the members with ``Cause.parse``: every cause survives the trip, and a
text that is not a cause is refused (None), never misread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollcall.membership.cause import Cause, CauseKind
from rollcall.protocol.wire import causes_from_pb

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@given(kind=st.sampled_from(CauseKind), member=ids, reporter=ids)
def test_every_cause_reads_back_from_its_wire_text(kind: CauseKind, member: str,
                                                   reporter: str) -> None:  # fmt: skip
    cause = Cause(kind, member, reporter if kind is CauseKind.REPORT else None)
    assert Cause.parse(str(cause)) == cause


@pytest.mark.parametrize(
    "text",
    ["", "join", "join:", "crash:w1", "leave:w1 by w2", "report:w1", "report:w1 by ",
     "suspect:w 1", "JOIN:w1"],
)  # fmt: skip
def test_a_text_that_is_not_a_cause_is_refused(text: str) -> None:
    assert Cause.parse(text) is None


def test_the_members_keep_the_causes_they_can_read() -> None:
    texts = ["join:w4-e", "something new:w1", "report:w1-b by w0-a"]
    assert causes_from_pb(texts) == (Cause.join("w4-e"), Cause.report("w1-b", "w0-a"))
