"""Files and directories of one user: created open to their owner only
(directories 0700, files 0600) from the moment they exist, and existing
ones refused when another user owns them or may write them.

A directory in a shared place (``/tmp``) can be created first by someone
else, and a file created with the default mode is readable by everyone
until it is chmod'ed: both have cost tokens and weights before.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO


class UnsafePath(ValueError):
    """A directory or file that another user owns or may change: using it
    would hand them what rollcall keeps there. The message says what to do."""


def private_directory(path: Path, what: str = "directory") -> Path:
    """``path`` as a directory of this user's that no one else may enter:
    created with mode 0700 if absent (its parents as usual), refused with
    :class:`UnsafePath` if it is a symbolic link or not a directory, belongs
    to another user, or is open to group or others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private(path, what, directory=True)
    return path


def check_private(path: Path, what: str, directory: bool) -> None:
    """Refuse (:class:`UnsafePath`) ``path`` unless it is a directory (or a
    regular file) of this user's that group and others can neither write
    nor, for a directory, enter."""
    info = path.lstat()
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    noun = "directory" if directory else "regular file"
    if not kind(info.st_mode):
        raise UnsafePath(f"refusing the {what} {path}: it is not a {noun} (a link?)")
    if info.st_uid != os.getuid():
        raise UnsafePath(
            f"refusing the {what} {path}: it belongs to uid {info.st_uid}, not to this user "
            f"({os.getuid()}); someone else may have created it to read what rollcall puts "
            "there: remove it"
        )
    mode = info.st_mode & 0o777
    if mode & (0o077 if directory else 0o022):
        raise UnsafePath(
            f"refusing the {what} {path}: it is open to other users (mode {mode:o}); "
            f"chmod {'700' if directory else '600'} it"
        )


def create_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file ``path`` of mode 0600 that replaces
    any old one at once (written beside it, then renamed over it)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a strict umask may have taken the owner's bits too
        with open(fd, "w", closefd=False) as file:
            file.write(text)
    finally:
        os.close(fd)
    os.replace(partial, path)


def open_private_append(path: Path, binary: bool = False) -> IO[str] | IO[bytes]:
    """``path`` opened for appending; created with mode 0600 if new
    (an existing file keeps its mode). Never follows a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    if binary:
        return open(fd, "ab")
    return open(fd, "a", encoding="utf-8")
