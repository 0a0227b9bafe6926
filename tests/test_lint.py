"""The code stays ruff-clean and the core stays mypy-clean (STYLE.md)."""

import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration  # starts processes


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_finds_nothing():
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_packages_type_check_with_mypy():
    result = run("mypy", "membership", "rendezvous", "rollcall", "worker")
    assert result.returncode == 0, result.stdout + result.stderr
