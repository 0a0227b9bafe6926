"""The committed gRPC code matches the .proto sources."""

import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration  # starts processes


def test_generated_grpc_code_is_up_to_date_with_proto_sources():
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_use_relative_imports():
    grpc_module = (ROOT / "rollcall" / "pb" / "rendezvous_pb2_grpc.py").read_text()
    assert "from . import rendezvous_pb2" in grpc_module
    assert "from rollcall.v1" not in grpc_module
