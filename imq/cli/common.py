"""What the ``imq`` subcommands share: the argument parser, value types, path checks, the
replacement of a database directory, the check of a queue's close, and a progress
heartbeat.

Ids that start with ``-``. Masterchain shards, block ids and file names start with
``-1``: ``--shard -1:8000000000000000``, ``--block-id -1:8000000000000000:57``,
``-1_8000000000000000_57_....queue``. argparse takes any ``-`` word that is not a
plain negative number for an option; :class:`Parser` widens its "negative number"
pattern to ``-<digits>`` followed by ``:``, ``_`` or ``.``, so such words are values
wherever they appear. A ``--`` right before one of them is accepted and dropped
(:func:`normalize_argv`), so options may still follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from time import monotonic
from types import TracebackType
from typing import Any, Protocol, TextIO

from imq.config import QueueConfig
from imq.errors import DatabaseLockedError, FileAccessError, ImqError, StorageError
from imq.queue import Queue
from imq.state.block import parse_block_id_name
from imq.storage.rocks import LOCK_FILE
from imq.types import BlockId, ShardIdent

__all__ = [
    "Commands",
    "Heartbeat",
    "Parser",
    "PathError",
    "block_id_arg",
    "checked_queue",
    "database_dir",
    "input_file",
    "new_database_dir",
    "normalize_argv",
    "output_file",
    "shard_arg",
    "wipe_database",
]

# A plain negative number, or -<digits> then ':', '_' or '.' and anything: an id or a file
# name of the masterchain, never an option of imq.
_HELP_WIDTH = 88
_NEGATIVE_OR_ID = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+[:_.].*$")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes ``-1:...`` and ``-1_...`` words for values. The
    epilog (examples) is printed as written; a one-paragraph description is wrapped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        description = kwargs.get("description")
        if description and "\n" not in description:
            kwargs["description"] = textwrap.fill(description, _HELP_WIDTH)
        super().__init__(*args, **kwargs)
        # argparse consults this pattern to tell a value that starts with '-' from an
        # option (it is set per parser in ArgumentParser.__init__; subparsers are built
        # with this same class).
        self._negative_number_matcher = _NEGATIVE_OR_ID


class Commands(Protocol):
    """What ``register(commands)`` gets: argparse's subparsers action."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Drop a ``--`` that comes right before an id-like word (``-1_....queue``): the word
    is a value anyway (:class:`Parser`), and the options after it still count."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--" and i + 1 < len(argv) and _NEGATIVE_OR_ID.match(argv[i + 1]):
            continue
        out.append(arg)
    return out


# -- value types --------------------------------------------------------------------------------


def shard_arg(text: str) -> ShardIdent:
    """``--shard`` values: ``wc:prefix16``."""
    try:
        return ShardIdent.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def block_id_arg(text: str) -> BlockId:
    """Block ids: ``wc:shard:seqno`` (no hashes), ``wc:shard:seqno:root:file``, or a
    node's file name (``wc_shard_seqno_root_file[.queue]``)."""
    try:
        return BlockId.parse(text)
    except ValueError:
        pass
    try:
        return parse_block_id_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a block id: {text!r} (expected wc:shard:seqno or wc:shard:seqno:root:file)"
        ) from None


# -- paths --------------------------------------------------------------------------------------


class PathError(ImqError):
    """A path given to the command cannot be used; the message says why."""


def _holds_database(path: Path) -> bool:
    return (path / "CURRENT").is_file()


def database_dir(path: Path) -> Path:
    """An existing queue database directory, or one clear :class:`PathError`."""
    if not path.exists():
        raise PathError(f"no queue database at {path}: the path does not exist")
    if not path.is_dir():
        raise PathError(f"no queue database at {path}: it is a file, not a directory")
    if not _holds_database(path):
        raise PathError(f"no queue database at {path}: the directory holds no database")
    return path


def new_database_dir(path: Path) -> Path:
    """Where a database may be created or reused: missing, empty, or a queue database."""
    if path.exists() and not path.is_dir():
        raise PathError(f"{path} is a file, not a queue database directory")
    if path.is_dir() and not _holds_database(path) and any(path.iterdir()):
        raise PathError(
            f"{path} holds other files but no queue database; give a new or empty directory"
        )
    return path


def input_file(path: Path, what: str) -> Path:
    """A file to read, or one clear :class:`PathError`."""
    if not path.exists():
        raise PathError(f"{what} {path} does not exist")
    if path.is_dir():
        raise PathError(f"{what} {path} is a directory, not a file")
    return path


def output_file(path: Path) -> Path:
    """A file to write (replaced if it exists), in a directory that exists."""
    if path.is_dir():
        raise PathError(f"output {path} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise PathError(f"cannot write {path}: directory {parent} does not exist")
    return path


# -- replacing a database -----------------------------------------------------------------------

# What a queue database directory holds: RocksDB's files (temporary ones included), the
# config rocksdict writes, and imq's lock. Anything else is someone's, and is never deleted.
_DATABASE_FILE = re.compile(
    r"CURRENT|IDENTITY|LOCK|LOG(\.old\.\d+)?|(MANIFEST|OPTIONS)-\d+(\.dbtmp)?"
    r"|\d+\.(sst|log|blob|dbtmp)|rocksdict-config\.json|" + re.escape(LOCK_FILE)
)


def _not_database_files(path: Path) -> list[str]:
    return sorted(
        e.name
        for e in os.scandir(path)
        if not (_DATABASE_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False))
    )


def _check_replaceable(path: Path) -> bool:
    """Whether ``path`` holds a database to delete (``False``: nothing to delete), or one
    clear :class:`PathError` when it holds anything that is not an imq database's."""
    if not path.exists():
        return False
    if not path.is_dir():
        raise PathError(f"{path} is a file, not a queue database directory; it is not deleted")
    others = _not_database_files(path)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise PathError(
            f"{path} holds other files than a queue database's ({shown}); it is not "
            "deleted: give a new or empty directory, or a queue database's"
        )
    names = os.listdir(path)
    if names and LOCK_FILE not in names:  # imq writes its lock file into every database
        raise PathError(
            f"{path} holds a RocksDB database that imq did not create; it is not deleted"
        )
    return bool(names)


def wipe_database(path: Path) -> None:
    """Empty ``path`` so that a new queue database can be made there (the demo's). Only a
    directory that holds nothing but an imq queue database's files is emptied, and only
    under the database's lock: never beside a live writer, which holds it
    (:class:`~imq.errors.DatabaseLockedError`). The lock file itself stays, so a writer
    that opens the directory meanwhile still locks the same file."""
    if not _check_replaceable(path):
        return
    lock = path / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError as exc:
        raise FileAccessError(lock, "open the lock of queue database", exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatabaseLockedError(
                f"queue database {path} is already open (in this or another process); "
                "it is not deleted: stop that process first"
            ) from None
        _check_replaceable(path)  # again, now that no writer can add to it
        for name in os.listdir(path):
            if name != LOCK_FILE:
                try:
                    (path / name).unlink(missing_ok=True)
                except OSError as exc:
                    raise FileAccessError(path / name, "delete", exc) from exc
    finally:
        os.close(fd)  # releases the lock


# -- a queue's close ------------------------------------------------------------------------------


def _damaged_hint(path: Path) -> str:
    return (
        f"run `imq verify {path}`, and if the files are damaged restore the directory from "
        "a copy (or rebuild it from a persistent state)"
    )


@contextlib.contextmanager
def checked_queue(path: Path, operation: str) -> Iterator[Queue]:
    """The queue at ``path``, opened for a command that writes (GC off), whose work must
    be known done: when RocksDB reports an error as the queue closes
    (:attr:`Queue.close_error`), raise :class:`~imq.errors.StorageError`. A failed
    background job shows only there: a manual compaction that met a damaged table file
    returns as if it had succeeded. A :class:`~imq.errors.StorageError` raised inside
    for damaged files (a write refused after a background job met them, say) gets the
    same advice instead of the library's "open it again", which would not help."""
    try:
        with Queue.open(path, QueueConfig(gc_enabled=False)) as queue:
            yield queue
    except StorageError as exc:
        if "Corruption" not in exc.reason:
            raise
        raise StorageError(path, exc.operation, exc.reason, _damaged_hint(path)) from exc
    if queue.close_error is not None:
        raise StorageError(
            path,
            operation,
            f"RocksDB failed as the queue closed: {queue.close_error}",
            hint=f"the {operation} may not be done; {_damaged_hint(path)}",
        )


# -- progress -----------------------------------------------------------------------------------


class Heartbeat:
    """Progress on stderr for work that has no natural count (a GC pass, a compaction):
    nothing for the first second, then the status and the elapsed time, redrawn every
    second on a terminal or printed every ten seconds otherwise, and a last line at the
    end if anything was shown."""

    def __init__(
        self,
        label: str,
        *,
        enabled: bool = True,
        after: float = 1.0,
        stream: TextIO | None = None,
    ) -> None:
        self._label = label
        self._enabled = enabled
        self._after = after
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every = 1.0 if self._tty else 10.0
        self._status = "working"
        self._shown = False
        self._started = monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="imq-cli-progress", daemon=True)

    def update(self, status: str) -> None:
        self._status = status

    def progress(self, unit: str) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback that sets the status to ``done/total unit``."""

        def report(done: int, total: int) -> None:
            self.update(f"{done:,}/{total:,} {unit}")

        return report

    def _write(self, final: bool) -> None:
        with self._lock:
            line = f"{self._label}: {self._status} ({monotonic() - self._started:.0f} s)"
            end = "\n" if final or not self._tty else ""
            self._stream.write(f"\r{line}{end}" if self._tty else f"{line}{end}")
            self._stream.flush()
            self._shown = True

    def _loop(self) -> None:
        if self._done.wait(self._after):
            return
        while True:
            self._write(final=False)
            if self._done.wait(self._every):
                return

    def __enter__(self) -> Heartbeat:
        self._started = monotonic()
        if self._enabled:
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._shown:
            self._write(final=True)
