"""Where the job token comes from (rollcall.protocol.wire.read_token), and the
token file `up` writes: open to its owner only from the moment it exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollcall.protocol.wire import TOKEN_ENV, TOKEN_FILE_ENV, read_token, write_token_file
from tests.harness import ROOT


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    given, named = tmp_path / "given", tmp_path / "named"
    given.write_text("from-the-flag\n")
    named.write_text("from-the-variable\n")
    return given, named


def test_an_explicit_file_comes_first(files, monkeypatch):
    given, named = files
    monkeypatch.setenv(TOKEN_FILE_ENV, str(named))
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert read_token(given) == "from-the-flag"


def test_the_file_named_in_the_environment_comes_before_the_token_itself(files, monkeypatch):
    _, named = files
    monkeypatch.setenv(TOKEN_FILE_ENV, str(named))
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert read_token(None) == "from-the-variable"


def test_the_token_in_the_environment_comes_last(monkeypatch):
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert read_token(None) == "from-the-environment"


def test_an_unreadable_named_file_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    with pytest.raises(ValueError, match="cannot read token file .*missing"):
        read_token(None)


def test_no_token_anywhere_names_every_way_to_give_one(monkeypatch):
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError) as raised:
        read_token(None)
    assert all(way in str(raised.value) for way in ("--token-file", TOKEN_FILE_ENV, TOKEN_ENV))


#: Writes a token file with the umask at 0 (which would leave a plain file
#: 0666) and records the file's mode at every audit event of the process
#: once it exists: a file made first and restricted after shows its wider
#: mode at the os.chmod event.
_OBSERVE = """
import json, os, sys
from pathlib import Path
from rollcall.protocol.wire import write_token_file

path, seen, inside = Path(sys.argv[1]), set(), []

def hook(event, args):
    if inside:
        return
    inside.append(1)
    try:
        if path.exists():
            seen.add(path.stat().st_mode & 0o777)
    finally:
        inside.clear()

sys.addaudithook(hook)
os.umask(0)
write_token_file(path, "s3cret")
print(json.dumps({"seen": sorted(seen), "final": path.stat().st_mode & 0o777}))
"""


@pytest.mark.integration
def test_the_token_file_is_0600_from_its_creation(tmp_path):
    path = tmp_path / "token"
    result = subprocess.run(
        [sys.executable, "-c", _OBSERVE, str(path)], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    observed = json.loads(result.stdout)
    assert observed["final"] == 0o600
    assert set(observed["seen"]) <= {0o600}, f"visible as {[oct(m) for m in observed['seen']]}"
    assert path.read_text() == "s3cret"


def test_an_existing_token_file_is_left_as_it_is(tmp_path):
    path = tmp_path / "token"
    path.write_text("kept")
    assert write_token_file(path, "other") is False
    assert path.read_text() == "kept"
