"""The code stays ruff-clean, the core mypy-clean (STYLE.md), and the import
layers hold (the contracts in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

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
    result = run("mypy", "-p", "rollcall")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_import_layers_hold():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is a test dependency: run scripts/setup"
    result = subprocess.run([lint_imports], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_an_installed_rollcall_is_one_import_name(tmp_path):
    """Outside the repository (no checkout on the path) only ``rollcall``
    imports: a user's own ``worker.py`` can never shadow ours."""
    probe = (
        "import importlib.metadata as m, importlib.util as u\n"
        "from rollcall import Elastic\n"
        "print(m.distribution('torch-rollcall').read_text('top_level.txt').split())\n"
        "print([n for n in ('membership', 'rendezvous', 'worker') if u.find_spec(n)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["['rollcall']", "[]"], result.stdout
