"""Read-only opens of a directory this process cannot write.

rocksdict writes its config file (``rocksdict-config.json``) into the directory it opens,
at every open, read-only ones too: on another user's node or a read-only mount that
write fails. RocksDB itself writes nothing in a read-only open, so imq opens, instead,
a private temporary directory of symbolic links to the database's files
(:class:`Shadow`). The process holds an ``flock`` on it while it lives; it is removed at
the store's close (or when the store is collected), and one a killed process left
behind is swept by a later open of the same user (:func:`_sweep_shadows`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
import weakref
from pathlib import Path

from imq.errors import FileAccessError

__all__ = [
    "ROCKSDICT_CONFIG",
    "SHADOW_HINT",
    "Shadow",
    "real_names",
    "temporary_directory",
    "writable_for_rocksdict",
]

ROCKSDICT_CONFIG = "rocksdict-config.json"


def writable_for_rocksdict(path: Path) -> bool:
    """Whether rocksdict can write its config file into ``path`` at an open (it does at
    every open, read-only ones too): the directory is writable for this process's
    effective user (``False`` on a read-only mount, for root too), and the file, where it
    exists, is a regular file (not a link, which rocksdict's write would follow: another
    user's database could point it at any file root may write) that opens for writing.
    That open is tried, not asked of ``access()``, whose answer AppArmor and Landlock do
    not change: a confined operator's tool was told "writable", and its open then failed
    on rocksdict's write. Opening for writing without truncating changes nothing in the
    file (nor its times); non-blocking, so a FIFO put there cannot hang the open."""
    effective = os.access in os.supports_effective_ids
    if not os.access(path, os.W_OK, effective_ids=effective):
        return False
    config = path / ROCKSDICT_CONFIG
    try:
        if not stat.S_ISREG(os.lstat(config).st_mode):
            return False  # a link, a FIFO, a directory...: the links' own config instead
        fd = os.open(
            config, os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NOFOLLOW | os.O_NONBLOCK
        )
    except FileNotFoundError:
        return True  # created at the open: the directory's permission decides
    except OSError:
        return False
    os.close(fd)
    return True


_SHADOW_PREFIX = "imq-read-only-"
# The directories of links in use: theirs -> the database's (for RocksDB's error texts).
_LIVE_SHADOWS: dict[str, str] = {}


def real_names(text: str) -> str:
    """``text`` (RocksDB's words) with any directory of links named as its database."""
    if _SHADOW_PREFIX in text:
        for shadow, real in list(_LIVE_SHADOWS.items()):
            text = text.replace(shadow, real)
    return text


# What a failure in the temporary directory of links means for the user.
SHADOW_HINT = (
    "the read-only open of a directory this process cannot write links the database's "
    "files from a private directory in the temporary directory ($TMPDIR, else /tmp): "
    "free space (and inodes) there, or point TMPDIR to a writable directory that allows "
    "symbolic links; or open a copy of the database"
)


def temporary_directory(exc: OSError) -> str | None:
    """Where :class:`Shadow` failed to make its directory (``exc`` raised by it): the
    parent of the path ``exc`` names, else tempfile's directory, else ``None`` (tempfile
    found no usable directory at all)."""
    if exc.filename is not None:
        return os.path.dirname(os.fsdecode(exc.filename))
    return tempfile.tempdir


def _remove_tree(path: str, owner: int, held: int) -> None:
    """Remove ``path`` and let go of its lock (the descriptor ``held``), unless this is
    a process forked from ``owner``, whose copy of the store must leave the parent's
    directory alone. Interrupted (Ctrl-C), the removal is finished before the
    interruption goes on: a finalizer runs once."""
    _LIVE_SHADOWS.pop(path, None)
    if os.getpid() != owner:
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.close(held)


# A directory of links unlocked for less than this long may be one whose process has
# just made it and not yet locked it: the sweep leaves it.
_SWEEP_AGE = 60.0  # seconds


def _sweep_shadows(directory: str) -> None:
    """Remove the directories of links left in ``directory`` by this user's processes
    that are gone (a kill, or an interruption at the wrong instant). A live one holds a
    lock on its directory (``flock``: released by the kernel when the process ends, and
    seen across PID namespaces, so a container sharing the directory is safe); a
    directory holding anything but links and rocksdict's config, another user's, or one
    younger than ``_SWEEP_AGE`` is left alone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    me = os.geteuid()
    for entry in entries:
        if not entry.name.startswith(_SHADOW_PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if (
                info.st_uid != me
                or not stat.S_ISDIR(info.st_mode)
                or time.time() - info.st_mtime < _SWEEP_AGE
            ):
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its process lives
            inside = list(os.scandir(entry.path))
            if all(e.is_symlink() or e.name == ROCKSDICT_CONFIG for e in inside):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue
        finally:
            os.close(fd)


class Shadow:
    """A private temporary directory of symbolic links to a database's files, for the
    read-only open of a directory this process cannot write (another user's node, a
    read-only mount): rocksdict writes its config file into the directory it opens, at
    every open, and a read-only RocksDB reads through the links and writes nothing. The
    config is not linked: rocksdict writes its own copy here. The process holds a lock
    on the directory while it lives; the directory is removed at the store's close, or
    when the store is collected, and one a killed process left by the next one made
    (:func:`_sweep_shadows`)."""

    def __init__(self, of: Path) -> None:
        self._of = Path(os.path.abspath(of))
        owner = os.getpid()
        made = tempfile.mkdtemp(prefix=f"{_SHADOW_PREFIX}{owner}-")
        held = -1
        try:
            held = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self._remove = weakref.finalize(self, _remove_tree, made, owner, held)
        except BaseException:
            _remove_tree(made, owner, held)
            raise
        self.path = Path(made)
        _LIVE_SHADOWS[made] = str(self._of)
        _sweep_shadows(str(self.path.parent))

    def link(self) -> Path:
        """Link every file of the database as it is named now (again at each attempt of
        the open: a live writer renames and deletes its files); return the directory.
        ``FileAccessError`` names the directory that failed: the database's (listing
        it) or the temporary one (making the links)."""
        try:
            names = os.listdir(self._of)
        except OSError as exc:
            raise FileAccessError(self._of, "list the files of queue database", exc) from exc
        try:
            for name in os.listdir(self.path):
                os.unlink(self.path / name)
            for name in names:
                if name != ROCKSDICT_CONFIG:
                    os.symlink(self._of / name, self.path / name)
        except OSError as exc:
            raise FileAccessError(
                self.path, "link the database's files into", exc, SHADOW_HINT
            ) from exc
        return self.path

    def remove(self) -> None:
        self._remove()
