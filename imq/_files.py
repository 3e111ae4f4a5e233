"""File-system steps that more than one part of imq takes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["sync_directory"]


def sync_directory(directory: Path) -> None:
    """fsync ``directory``: a name created or renamed in it is on disk only then (POSIX:
    a file's own fsync does not cover its entry in the directory), so a power loss after
    the caller returned cannot take the name away. Passed over: a directory this user
    may write but not read (``EACCES``, ``EPERM``: it cannot be opened to sync), and a
    file system that cannot sync a directory (``EINVAL``, ``ENOTSUP``); neither offers
    anything stronger to ask for. Any other failure raises ``OSError``."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
