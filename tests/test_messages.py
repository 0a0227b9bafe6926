"""What a person reads: view changes name members and causes, gloo's raw text
is replaced by a few words, and the default handler prints without any
logging configuration but steps aside once the program configures logging."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollcall.membership.cause import Cause
from rollcall.membership.view import Member, View
from rollcall.worker.messages import describe_transport, view_change
from tests.harness import ROOT


def _view(epoch: int, ids: list[str], resume: int | None = 216) -> View:
    return View(epoch, tuple(Member(i, f"127.0.0.1:{1000 + n}") for n, i in enumerate(ids)), resume)


def test_a_view_change_names_who_was_lost_who_left_and_who_joined() -> None:
    before = _view(4, ["w0-a", "w1-b", "w2-c", "w3-d"])
    after = _view(5, ["w0-a", "w3-d", "w4-e"])
    causes = (Cause.suspect("w1-b"), Cause.leave("w2-c"), Cause.join("w4-e"))
    line = view_change(before, after, 1, causes, "w0-a")
    assert line == ("view 5: 3 members (w1-b lost, w2-c left, w4-e joined); rank 1, step 217 next")


def test_a_member_reported_failing_is_named_with_its_reporter() -> None:
    before = _view(4, ["w0-a", "w1-b"])
    line = view_change(before, _view(5, ["w0-a"]), 0, (Cause.report("w1-b", "w0-a"),), "w0-a")
    assert line == "view 5: 1 member (w1-b lost (reported failing by w0-a)); rank 0, step 217 next"


def test_the_first_view_of_a_new_job_says_it_starts() -> None:
    line = view_change(None, _view(1, ["w0-a"], resume=None), 0, (Cause.join("w0-a"),), "w0-a")
    assert line == "view 1: 1 member; rank 0, step 0 next"


def test_gloo_text_becomes_a_few_words() -> None:
    raw = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:22939: Connection reset by peer"
    )
    assert describe_transport(raw) == "a peer reset its connection (it crashed or was killed)"
    closed = "[pair.cc:553] Connection closed by peer [127.0.0.1]:15790. ... GLHF!"
    assert "GLHF" not in describe_transport(closed)
    assert describe_transport("Timed out waiting 30000ms for recv") == (
        "a peer did not answer in time"
    )


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.integration
def test_the_default_handler_prints_without_any_logging_configuration() -> None:
    result = _run(
        "import logging\n"
        "from rollcall.worker.messages import install_default_handler\n"
        "install_default_handler()\n"
        "logging.getLogger('rollcall.worker').info('view 3: 2 members')\n"
        "logging.getLogger('rollcall.worker').debug('noise')\n"
    )
    assert result.stderr == "rollcall: view 3: 2 members\n"


@pytest.mark.integration
def test_the_default_handler_steps_aside_once_the_program_configures_logging() -> None:
    result = _run(
        "import logging, sys\n"
        "from rollcall.worker.messages import install_default_handler\n"
        "install_default_handler()\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format='%(message)s')\n"
        "logging.getLogger('rollcall.worker').info('hidden at WARNING')\n"
        "logging.getLogger('rollcall.worker').warning('shown once')\n"
    )
    assert result.stderr == "shown once\n"


@pytest.mark.integration
def test_no_default_handler_when_logging_is_already_configured() -> None:
    result = _run(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr,\n"
        "                    format='%(name)s %(message)s')\n"
        "from rollcall.worker.messages import install_default_handler\n"
        "install_default_handler()\n"
        "logging.getLogger('rollcall.worker').info('through the root handler')\n"
    )
    assert result.stderr == "rollcall.worker through the root handler\n"
