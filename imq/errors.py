"""The imq exception tree.

Every error imq raises on purpose derives from :class:`ImqError`. Messages name the
block, shard, seqno, table or file offset involved, so an operator can act on a log line
alone. Invalid arguments raise the builtin ``ValueError`` / ``TypeError`` instead.
"""

from __future__ import annotations

import errno
import os
from typing import Any, ClassVar

__all__ = [
    "CommitError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptDataError",
    "DatabaseLockedError",
    "DiffBelowCommitPointerError",
    "DiffConflictError",
    "DiffSequenceError",
    "FileAccessError",
    "ImqError",
    "QueueClosedError",
    "ReadInterruptedError",
    "ReadOnlyError",
    "SchemaVersionError",
    "StartupError",
    "StateFormatError",
    "StorageError",
]


class ImqError(Exception):
    """Base class of every error imq raises on purpose.

    A subclass that builds its message from its constructor's arguments keeps them in
    ``_made_with``, and pickles by them: the default pickling (the message alone) would
    rebuild it wrongly, and an error must cross a process boundary as it was raised.
    """

    _made_with: tuple[Any, ...] | None = None
    _advised = False  # the message carries a step given at the raise: pickled as it is
    next_step: ClassVar[str] = ""
    """What to do about it, appended to a one-string message by the subclasses that set it."""

    def __init__(self, *args: object, next_step: str | None = None) -> None:
        """``next_step``, when given, replaces the class's for this error: a case whose
        way out differs from the usual one's (a conflict with a committed diff cannot
        be cleared away)."""
        if next_step is not None:
            self._advised = True  # pickled as raised, even with an empty step
            if next_step and len(args) == 1 and isinstance(args[0], str):
                args = (f"{args[0]}; {next_step}",)
        elif self.next_step and len(args) == 1 and isinstance(args[0], str):
            self._made_with = args
            args = (f"{args[0]}; {self.next_step}",)
        super().__init__(*args)

    def __reduce__(self) -> str | tuple[Any, ...]:
        if self._advised:
            return _as_raised, (type(self), self.args)
        if self._made_with is None:
            return super().__reduce__()
        return type(self), self._made_with


def _as_raised(cls: type[ImqError], args: tuple[object, ...]) -> ImqError:
    """An error rebuilt from its final arguments, its step not appended again."""
    error = cls.__new__(cls, *args)
    error.args = args
    error._advised = True
    return error


class DiffConflictError(ImqError):
    """A diff for the same block is already stored with a different hash."""

    next_step = (
        "the block was collated again differently: clear the uncommitted zone "
        "(clear_uncommitted_state, or startup after a restart) before applying the new diff, "
        "or check that the block id and hash belong together"
    )


class DiffSequenceError(ImqError):
    """``check_sequence`` is set and the diff's seqno is not the next one."""


class DiffBelowCommitPointerError(ImqError):
    """The diff's smallest message key is not above the shard's commit pointer."""


class CommitError(ImqError):
    """A commit cannot proceed: no masterchain block, a shard listed twice (two entries
    with a stored diff each), a required diff missing, or a pointer that would move
    backwards."""


class StartupError(ImqError):
    """The last committed masterchain block is ahead of the applied one."""


class StateFormatError(ImqError):
    """An import source is malformed or fails a check."""


class QueueClosedError(ImqError):
    """A call on a closed queue."""

    next_step = "open the queue again (Queue.open) to go on"


class ReadInterruptedError(ImqError):
    """An iterator's read was cut short by an exception that is not an error of imq's
    (a signal handler's ``TimeoutError``, a ``KeyboardInterrupt``, a ``MemoryError``):
    that exception was raised as it was, once; the rows the iterator had read ahead of
    its consumer are lost with it, so every later ``next()`` raises this instead of
    ending the range early."""

    next_step = (
        "close the iterator, and open a new one from its current_position() to read the rest"
    )


class ReadOnlyError(ImqError):
    """A call that changes the queue, on a handle opened with ``read_only=True``."""

    next_step = (
        "open the queue without read_only=True to change it (one writer at a time: close "
        "the other handle)"
    )


class DatabaseLockedError(ImqError):
    """The database directory is already open by a writer."""

    next_step = (
        "one writer at a time: close the other handle (or stop the process that holds it), "
        "or look at the live queue with Queue.open(path, read_only=True) or `imq inspect`"
    )


class ConfigError(ImqError, ValueError):
    """A configuration file or value is invalid. Also a ``ValueError``: a bad value given
    to ``QueueConfig(...)`` is both what the API's rule for constructors says (a
    ``ValueError``) and what its errors table says (a ``ConfigError``)."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type (``QueueConfig(sync_commits=1)``): a
    ``ConfigError`` and a ``TypeError``."""


class CorruptDataError(ImqError):
    """Bytes stored in the database cannot be decoded, or RocksDB found a damaged block
    (checksum mismatch) while reading: a scan that meets one raises this error instead
    of ending early.

    ``table`` names the column family, ``key`` the raw key (hex in the message): for a
    damaged block, the last key read before it (or the scan's start). The database files
    are damaged: run ``imq verify DB``, then restore the directory from a copy or rebuild
    it from a persistent state (``import_state``).
    """

    def __init__(self, table: str, key: bytes, reason: str) -> None:
        self._made_with = (table, key, reason)
        super().__init__(
            f"corrupt row in table {table!r} at key {key.hex()}: {reason}; the database files "
            "are damaged: run `imq verify` on the directory, then restore it from a copy or "
            "rebuild it from a persistent state in a new directory"
        )
        self.table = table
        self.key = key
        self.reason = reason


class StorageError(ImqError):
    """RocksDB failed an operation on the database files (an I/O error such as a full
    disk, or a damaged file found by a read).

    ``path`` is the database directory, ``operation`` what imq was doing, ``hint`` what
    to do about it (the message ends with it). After a failed write the handle is dead:
    every later call raises this error again. Free the space or fix the fault,
    ``close()`` the queue (that always releases the directory) and open it again; nothing
    a failed call staged was written, except where ``operation`` is
    :attr:`UNSYNCED_OPERATION`: RocksDB took a synced write's batch and then the sync of
    its log failed, so the reopen shows the change whole or not at all (check before
    retrying). A write can also fail on a damaged table file that one of RocksDB's
    compactions read: the hint then says so, since a reopen brings the same compaction
    back (``imq verify``, then a copy or a persistent state).
    """

    WRITE_HINT: ClassVar[str] = (
        "close the queue and open it again (after a failed write this handle is dead; "
        "nothing the failed call staged was written)"
    )
    UNSYNCED_OPERATION: ClassVar[str] = "the log's sync after a write"

    def __init__(
        self,
        path: object,
        operation: str,
        reason: str,
        hint: str = WRITE_HINT,
    ) -> None:
        self._made_with = (path, operation, reason, hint)
        self.hint = hint
        super().__init__(
            f"storage error in queue database {path} during {operation}: {reason}; {hint}"
        )
        self.path = path
        self.operation = operation
        self.reason = reason

    def again(self) -> StorageError:
        """What every later call on the handle this error killed raises."""
        if self.operation == self.UNSYNCED_OPERATION:  # its hint speaks of that call's batch
            return StorageError(
                self.path,
                f"a call after {self.operation} failed",
                f"this handle is dead: {self.reason}",
                "close the queue and open it again (this call wrote nothing; whether the "
                "earlier call's change survives, the reopen shows, whole or not at all)",
            )
        return StorageError(
            self.path, self.operation, f"this handle is dead: {self.reason}", self.hint
        )


class FileAccessError(ImqError, OSError):
    """A file or directory imq was given cannot be used: it is missing, of the wrong kind
    (a directory where a file belongs, or the reverse), not permitted, on a read-only file
    system, or the disk is full.

    It is also an ``OSError``: ``errno`` and ``filename`` are the operating system's,
    ``operation`` is what imq was doing. The message ends with what to do about it.
    """

    def __init__(self, path: object, operation: str, exc: OSError, hint: str = "") -> None:
        self._made_with = (path, operation, exc, hint)
        reason = exc.strerror or str(exc)
        hint = hint or _ERRNO_HINTS.get(exc.errno or 0, "check the path and retry")
        super().__init__(exc.errno, f"cannot {operation} {path}: {reason}; {hint}")
        self.filename = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        self.operation = operation

    def __str__(self) -> str:
        return str(self.strerror)

    def noting(self, note: str) -> FileAccessError:
        """The same error with ``note`` said before its hint (what else the caller must
        know: that the call took effect all the same, say)."""
        assert self._made_with is not None  # set by __init__
        path, operation, exc, hint = self._made_with
        hint = hint or _ERRNO_HINTS.get(exc.errno or 0, "check the path and retry")
        return FileAccessError(path, operation, exc, f"{note}; {hint}")


_ERRNO_HINTS = {
    errno.ENOENT: "check the path (it, or a directory on the way to it, does not exist)",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "it is a directory: pass a file",
    errno.EACCES: "check the permissions of the file and its directory",
    errno.EPERM: "check the permissions of the file and its directory",
    errno.EROFS: "the file system is read-only: use a writable location",
    errno.ENOSPC: "the disk is full: free space (or choose another disk) and retry",
    errno.EMFILE: "the process ran out of file descriptors: raise its limit (ulimit -n) and retry",
    errno.ENFILE: "the system ran out of file descriptors: close some files and retry",
    errno.EDQUOT: "the disk quota is exhausted: free space and retry",
    errno.ENAMETOOLONG: "the path is too long: use a shorter one",
}


class SchemaVersionError(ImqError):
    """The database was written by an incompatible version of imq."""
