"""A Ctrl-C or SIGTERM that reaches a worker while it imports torch is not
lost. torch imports numpy from its C extension and drops any error that
import raises, KeyboardInterrupt included: without care, a worker told to
stop while it starts trains on until it is killed (``rollcall up`` waited
15 s, then SIGKILLed it).

The signal is sent at exactly that moment by an import hook that fires
when numpy is first looked up, in a real ``rollcall worker`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration

#: A sitecustomize: send this process ``SIG`` when numpy is first imported.
#: SIGINT gets Python's own handler first, as in a process started from a
#: terminal: one started with SIGINT ignored (a background job of a shell
#: without job control, as a test run may be) inherits that, Python then
#: installs none, and the test's SIGINT would be ignored rather than lost.
HOOK = """
import os, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)

class _SignalAtNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            sys.stderr.write("hook: {sig} sent\\n")
            os.kill(os.getpid(), signal.{sig})
        return None

sys.meta_path.insert(0, _SignalAtNumpy())
"""


def run_with_hook(tmp_path: Path, sig: str, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(HOOK.format(sig=sig))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert f"hook: {sig} sent" in done.stderr, done.stderr  # the signal came, at that moment
    return done


def test_torch_itself_loses_a_sigint_sent_while_it_imports_numpy(tmp_path: Path):
    """The hazard, shown: if this starts failing, torch fixed it, and the
    deferral of rollcall.worker.startup is no longer needed."""
    done = run_with_hook(tmp_path, "SIGINT", "-c", "import torch; print('imported')")
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr


def test_importing_elastic_keeps_a_sigint_for_after_torch(tmp_path: Path):
    program = (
        "import sys\n"
        "try:\n"
        "    from rollcall import Elastic\n"
        "    print('imported')\n"
        "except KeyboardInterrupt:\n"
        "    torch = sys.modules['torch']\n"
        "    print('interrupted; torch', 'whole' if hasattr(torch, 'nn') else 'half')\n"
    )
    done = run_with_hook(tmp_path, "SIGINT", "-c", program)
    assert done.stdout.strip() == "interrupted; torch whole", done.stdout + done.stderr


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", -signal.SIGTERM)])
def test_a_worker_signalled_while_it_imports_torch_stops_instead_of_joining(
    tmp_path: Path, sig: str, code: int
):
    token = tmp_path / "token"
    token.write_text("x")
    token.chmod(0o600)
    # Port 1 on loopback: nothing listens. A worker that lost the signal
    # would retry there for minutes; the timeout below would fail the test.
    done = run_with_hook(
        tmp_path, sig, "-m", "rollcall.cli", "worker", "--rendezvous", "127.0.0.1:1",
        "--job", "j", "--token-file", str(token),
    )  # fmt: skip
    assert done.returncode == code, done.stderr[-2000:]
    assert "cannot reach the rendezvous" not in done.stderr


def test_the_operators_commands_start_without_torch():
    """Holding signals while torch imports must not make the commands that
    need no torch import it (a second or more per command)."""
    modules = ["rollcall.cli", "rollcall.local", "rollcall.checkpoints", "rollcall.live",
               "rollcall.report.command", "rollcall.cli.up", "rollcall.worker.startup"]  # fmt: skip
    program = (
        "import importlib, sys\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in modules)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
